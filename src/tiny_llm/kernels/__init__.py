"""The kernels' host side: the extension's binding, the CPU kernel plans and the fused decode
layers, the BLAS shim, the device the engine plans for. Below every chapter.
"""
