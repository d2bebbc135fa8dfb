"""The course: its tasks and their stubs (``tasks``), a learner's workspace (``workspace``), and
the learner switch that imports a learner's chapters in place of the reference's (``learner``).
"""
