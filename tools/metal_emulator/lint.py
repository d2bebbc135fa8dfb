"""A lint for the MSL subset that compiles both as Metal and through the emulator.

The emulator accepts plenty of C++ that is not valid MSL, and Metal accepts
constructs the emulator cannot shim. These regex rules keep a .metal file
inside the subset both accept (docs: tools/metal_emulator/README.md). They
work on the comment-stripped
text, so commented-out code is ignored, and report ``path:line: message``.

Rules (numbered as in the README):
  1. only <metal_stdlib>-family system headers, no MLX-internal headers,
     ``using namespace metal;``, no ``std::``;
  2. kernels are ``[[kernel]] void name(...)``; template kernels are
     instantiated only as ``template [[host_name("x")]] [[kernel]]
     decltype(f<..>) f<..>;``;
  3. every kernel parameter has exactly one attribute: ``[[buffer(n)]]`` with
     a literal index, a position attribute, or ``[[threadgroup(n)]]``;
  4. buffers are ``device``/``constant`` pointers, or one ``constant P& p``
     where P is a struct of 4-byte scalar fields;
  5. one ``threadgroup T name[dims];`` per statement, no initialiser, at
     kernel scope;
  6. no multi-component swizzles;
  7. no textures or samplers;
  8. no ``return`` before a ``threadgroup_barrier`` in a kernel body;
  9. finite sentinels (``-FLT_MAX``), never ``INFINITY``;
 10. nothing the emulator cannot run or MSL lacks: double, half literals
     (``1.0h``), lambdas, exceptions, dynamic memory, atomics, simdgroup
     matrices other than 8x8, calls named ``buffer(...)`` (a macro in the shim), a
     transposed ``simdgroup_load``/``simdgroup_store`` with an origin (where Metal applies
     it is undocumented: offset the pointer instead).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from .source import (
    POSITION_ATTRIBUTES,
    MetalSource,
    MetalSourceError,
    Param,
    line_of,
    parse_source,
    strip_comments,
)

__all__ = ["lint_metal", "lint_source"]

#: Records a problem at a character offset of the source.
Flag = Callable[[int, str], None]

ALLOWED_SYSTEM_HEADERS = frozenset(
    {
        "metal_stdlib",
        "metal_simdgroup_matrix",
        "metal_simdgroup",
        "metal_math",
        "metal_compute",
        "metal_integer",
        "metal_common",
    }
)

_TG_DECL = re.compile(
    r"(?m)(?:^|(?<=[;{}]))[ \t]*threadgroup[ \t]+(?:const[ \t]+)?[A-Za-z_][\w:]*"
    r"(?:[ \t]*<[^;{}()\n]*?>)?[ \t]+[A-Za-z_]\w*[ \t]*(?:\[[^\[\];\n]+\][ \t]*)*;"
)
_TG_STATEMENT = re.compile(r"(?m)(?:^|(?<=[;{}]))[ \t]*threadgroup\b(?P<rest>[^;{]*)")
_ATTR_SPAN = re.compile(r"\[\[.*?\]\]", re.S)

_SIMPLE_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\bstd::"), "rule 1: no std:: in MSL"),
    (
        re.compile(r"\.(?:[xyzw]{2,4}|[rgba]{2,4})\b"),
        "rule 6: no multi-component swizzles; build the vector from components",
    ),
    (
        re.compile(r"\b(?:texture[123]d\w*|texturecube\w*|depth2d\w*|sampler)\b"),
        "rule 7: no textures or samplers",
    ),
    (
        re.compile(r"\bINFINITY\b|\bHUGE_VALF?\b|\binfinity\s*\(\s*\)"),
        "rule 9: use finite sentinels (-FLT_MAX): infinities are unreliable under fast math",
    ),
    (re.compile(r"\bdouble\b"), "rule 10: MSL has no double"),
    (
        re.compile(r"(?<![\w.])\d+(?:\.\d*)?(?:[eE][+-]?\d+)?[hH]\b"),
        "rule 10: half literals (1.0h) do not compile as C++; write half(1.0)",
    ),
    (re.compile(r"\[[=&][^\]]*\]\s*\(|\[\]\s*\("), "rule 10: no lambdas in MSL"),
    (
        re.compile(r"\b(?:printf|malloc|free|new|delete|throw|try|catch|virtual)\b"),
        "rule 10: not available in MSL",
    ),
    (re.compile(r"\batomic(?:_\w+|\s*<)"), "rule 10: atomics are not emulated"),
    (re.compile(r"\[\[\s*host_name\b"), ""),  # handled separately (needs the source spans)
]


def lint_metal(path: str | Path) -> list[str]:
    """Problems of the .metal file at ``path`` as ``path:line: message`` strings (empty: clean)."""
    p = Path(path)
    return lint_source(p.read_text(), p)


def lint_source(text: str, path: str | Path = "<string>") -> list[str]:
    """Lints MSL source ``text`` (reported as ``path``)."""
    problems: list[tuple[int, str]] = []

    def flag(pos: int, msg: str) -> None:
        problems.append((line_of(text, pos), msg))

    stripped = strip_comments(text)
    try:
        src = parse_source(text, path)
    except MetalSourceError as e:
        return [str(e)]

    _lint_includes(stripped, flag)
    inst_spans = src.instantiation_spans

    def in_instantiation(pos: int) -> bool:
        return any(a <= pos < b for a, b in inst_spans)

    for rx, msg in _SIMPLE_RULES:
        if not msg:
            continue
        for m in rx.finditer(stripped):
            flag(m.start(), msg)
    for m in re.finditer(r"\[\[\s*host_name\b", stripped):
        if not in_instantiation(m.start()):
            flag(
                m.start(),
                'rule 2: [[host_name]] only in `template [[host_name("x")]] '
                "[[kernel]] decltype(f<..>) f<..>;`",
            )
    for m in re.finditer(r"(?m)^\s*template\s*\[\[", stripped):
        if not in_instantiation(m.start() + len(m.group(0)) - 2):
            flag(m.start(), "rule 2: malformed kernel instantiation")

    _lint_simdgroup_origins(stripped, flag)
    _lint_kernels(src, stripped, flag, in_instantiation)
    _lint_threadgroup(src, stripped, flag)
    _lint_misc(stripped, flag)

    return [f"{path}:{line}: {msg}" for line, msg in sorted(set(problems))]


_SIMDGROUP_IO = re.compile(r"\bsimdgroup_(?:load|store)\s*\(")
_ZERO_ORIGIN = re.compile(r"ulong2\s*\(\s*0\s*(?:,\s*0\s*)?\)")


def _call_arguments(text: str, open_paren: int) -> list[str]:
    """The top-level arguments of the call whose ``(`` is at ``open_paren``."""
    args, depth, start = [], 0, open_paren + 1
    for i in range(open_paren, len(text)):
        c = text[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return [*args, text[start:i].strip()]
        elif c == "," and depth == 1:
            args.append(text[start:i].strip())
            start = i + 1
    return args


def _lint_simdgroup_origins(stripped: str, flag: Flag) -> None:
    for m in _SIMDGROUP_IO.finditer(stripped):
        args = _call_arguments(stripped, m.end() - 1)
        if (len(args) == 5 and args[4] != "false"
                and not _ZERO_ORIGIN.fullmatch(args[3])):
            flag(m.start(), "rule 10: a transposed simdgroup load/store with an origin: Apple "
                 "does not document where the origin applies; offset the pointer instead")


def _lint_includes(stripped: str, flag: Flag) -> None:
    for m in re.finditer(r'(?m)^\s*#\s*include\s*([<"])([^>"]+)[>"]', stripped):
        name = m.group(2).strip()
        if m.group(1) == "<" and name not in ALLOWED_SYSTEM_HEADERS:
            flag(
                m.start(),
                f"rule 1: system header <{name}> is outside the subset (use <metal_stdlib>)",
            )
        if m.group(1) == '"' and (name.startswith("mlx/") or "/mlx/" in name):
            flag(m.start(), f'rule 1: MLX-internal header "{name}"')
    if not re.search(r"#\s*include\s*<metal_stdlib>", stripped):
        flag(0, "rule 1: missing #include <metal_stdlib>")
    if not re.search(r"\busing\s+namespace\s+metal\s*;", stripped):
        flag(0, "rule 1: missing `using namespace metal;`")


def _lint_kernels(
    src: MetalSource, stripped: str, flag: Flag, in_instantiation: Callable[[int], bool]
) -> None:
    for m in re.finditer(r"\[\[\s*kernel\s*\]\]|\bkernel\b", stripped):
        if in_instantiation(m.start()):
            continue
        if not re.match(r"\s+void\s+[A-Za-z_]\w*\s*\(", stripped[m.end() :]):
            flag(m.start(), "rule 2: kernels are written `[[kernel]] void name(...)`")
    seen: dict[str, int] = {}
    for m in re.finditer(
        r"(?:\[\[\s*kernel\s*\]\]|\bkernel\b)\s+void\s+([A-Za-z_]\w*)\s*\(", stripped
    ):
        seen[m.group(1)] = seen.get(m.group(1), 0) + 1
        if seen[m.group(1)] == 2:
            flag(m.start(), f"rule 2: kernel {m.group(1)} is defined more than once")
    instantiated = {kd.name for kd, _ in src.entries.values()}
    for kd in src.kernels.values():
        if kd.templated and kd.name not in instantiated:
            flag_line(
                flag, src, kd.line, f"rule 2: template kernel {kd.name} is never instantiated"
            )
        indices: dict[int, str] = {}
        refs = 0
        for p in kd.params:
            where = f"parameter '{p.name}' of kernel {kd.name}"
            if len(p.attrs) != 1:
                flag_line(flag, src, p.line, f"rule 3: {where} needs exactly one attribute")
                continue
            attr, arg = p.attrs[0]
            if attr == "buffer":
                if p.buffer_index is None:
                    flag_line(
                        flag,
                        src,
                        p.line,
                        f"rule 3: {where}: buffer index must be an integer literal",
                    )
                    continue
                if p.buffer_index > 30:
                    flag_line(flag, src, p.line, f"rule 3: {where}: buffer index above 30")
                if p.buffer_index in indices:
                    flag_line(
                        flag,
                        src,
                        p.line,
                        f"rule 3: {where} reuses buffer({p.buffer_index}) "
                        f"of '{indices[p.buffer_index]}'",
                    )
                indices[p.buffer_index] = p.name
                _lint_buffer_type(src, stripped, p, where, flag)
                if p.type.endswith("&"):
                    refs += 1
                    if refs == 2:
                        flag_line(
                            flag, src, p.line, f"rule 4: {where}: one Params struct per kernel"
                        )
            elif attr == "threadgroup":
                if p.threadgroup_index is None:
                    flag_line(
                        flag, src, p.line, f"rule 3: {where}: threadgroup index must be a literal"
                    )
                if not re.match(r"threadgroup\b", p.type) or "*" not in p.type:
                    flag_line(flag, src, p.line, f"rule 3: {where}: must be a threadgroup pointer")
            elif attr in POSITION_ATTRIBUTES:
                if arg is not None:
                    flag_line(flag, src, p.line, f"rule 3: {where}: [[{attr}]] takes no argument")
            else:
                flag_line(flag, src, p.line, f"rule 3: {where}: unsupported attribute [[{attr}]]")
        _lint_return_before_barrier(stripped, kd.body_start, kd.body_end, flag)


def flag_line(flag: Flag, src: MetalSource, line: int, msg: str) -> None:
    """Flags by line number (converted back to an offset for ``flag``)."""
    pos = 0
    for _ in range(line - 1):
        pos = src.text.index("\n", pos) + 1
    flag(pos, msg)


def _lint_buffer_type(src: MetalSource, stripped: str, p: Param, where: str, flag: Flag) -> None:
    t = p.type
    if "*" in t:
        if not re.search(r"\b(?:device|constant)\b", t):
            flag_line(
                flag, src, p.line, f"rule 4: {where}: buffer pointers are `device` or `constant`"
            )
        return
    if t.endswith("&"):
        sname = p.struct_name
        if not re.match(r"(?:const\s+)?constant\b", t):
            flag_line(flag, src, p.line, f"rule 4: {where}: the Params reference is `constant P&`")
        if sname in {
            "int",
            "uint",
            "float",
            "half",
            "bool",
            "short",
            "ushort",
            "int32_t",
            "uint32_t",
        }:
            flag_line(
                flag,
                src,
                p.line,
                f"rule 4: {where}: scalar parameters belong in the kernel's Params struct",
            )
        elif sname not in src.structs:
            if sname and re.search(rf"\bstruct\s+{re.escape(sname)}\s*\{{", stripped):
                flag_line(flag, src, p.line, f"rule 4: {sname} must have only 4-byte scalar fields")
            else:
                flag_line(
                    flag, src, p.line, f"rule 4: {where}: Params struct {sname} is not defined here"
                )
        return
    flag_line(flag, src, p.line, f"rule 4: {where}: buffers are pointers or `constant P&`")


def _lint_return_before_barrier(stripped: str, start: int, end: int, flag: Flag) -> None:
    if start < 0:
        return
    body = stripped[start:end]
    barriers = [m.start() for m in re.finditer(r"\bthreadgroup_barrier\s*\(", body)]
    if not barriers:
        return
    for m in re.finditer(r"\breturn\b", body):
        if m.start() < barriers[-1]:
            flag(
                start + m.start(),
                "rule 8: return before a threadgroup_barrier (every thread must "
                "reach every barrier)",
            )


def _lint_threadgroup(src: MetalSource, stripped: str, flag: Flag) -> None:
    decls = {m.start() for m in _TG_DECL.finditer(stripped)}
    for m in _TG_STATEMENT.finditer(stripped):
        rest = m.group("rest")
        if m.start() not in decls:
            if "*" not in rest and "&" not in rest:
                flag(
                    m.start(),
                    "rule 5: one `threadgroup T name[dims];` per statement, no initialiser",
                )
            continue
        owner = next(
            (kd for kd in src.kernels.values() if kd.body_start <= m.start() < kd.body_end), None
        )
        if owner is None:
            flag(m.start(), "rule 5: threadgroup arrays are declared in a kernel body")
            continue
        seg = stripped[owner.body_start : m.start()]
        if seg.count("{") - seg.count("}") != 1:
            flag(
                m.start(), "rule 5: threadgroup arrays are declared at kernel scope, not in a block"
            )


def _lint_misc(stripped: str, flag: Flag) -> None:
    for m in re.finditer(r"simdgroup_matrix\s*<\s*\w+\s*,\s*(\d+)\s*,\s*(\d+)\s*>", stripped):
        if (m.group(1), m.group(2)) != ("8", "8"):
            flag(m.start(), "rule 10: only 8x8 simdgroup matrices are emulated")
    for m in re.finditer(r"\bsimdgroup_\w+?(\d+)x(\d+)\b", stripped):
        if (m.group(1), m.group(2)) != ("8", "8"):
            flag(m.start(), "rule 10: only 8x8 simdgroup matrices are emulated")
    outside = _ATTR_SPAN.sub(lambda m: " " * len(m.group(0)), stripped)
    for m in re.finditer(r"\bbuffer\s*\(", outside):
        flag(
            m.start(),
            "rule 10: 'buffer(' outside [[...]] collides with the emulator's attribute macro",
        )
