"""Reading .metal sources: comments, kernels, Params structs, and the pre-pass.

The pre-pass is the only source transformation the emulator makes; everything
else is done by the shim header. It

* rewrites each statement-initial ``threadgroup T name[dims];`` into a
  reference to a per-threadgroup allocation
  (``::mtl_emu::tg_ref<T[dims]> name = ::mtl_emu::tg_array<T[dims]>(...);``),
* refuses any other statement that starts with ``threadgroup`` and declares
  no pointer or reference (it would silently become per-thread storage),
* renames the ``[[threadgroup(n)]]`` parameter attribute (``threadgroup`` is
  a keyword macro in the shim) and position attributes (``[[thread_index_in_simdgroup]]``
  becomes ``[[MTL_EMU_POS(kLane)]]``, so a variable may bear the attribute's name),
* turns ``constant T*`` declarations into ``::mtl_emu::constant_ptr<T>``, a pointer
  type that, as in Metal, does not convert to a ``device`` pointer,
* blanks explicit ``template [[host_name("x")]] [[kernel]] decltype(f<..>)
  f<..>;`` instantiations and appends a registration for every kernel entry
  point (plain kernels by function name, instantiations by host name).

Invariant: replacements never add or remove newlines, so line numbers in
compiler errors and emulator reports match the original file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "POSITION_ATTRIBUTES",
    "KernelDef",
    "MetalSource",
    "MetalSourceError",
    "Param",
    "ParamsStruct",
    "line_of",
    "local_includes",
    "parse_source",
    "prepass",
    "strip_comments",
]


#: Thread-position attributes the shim supports, and its name for each.
POSITION_ATTRIBUTES = {
    "thread_position_in_grid": "kPosInGrid",
    "thread_position_in_threadgroup": "kPosInTg",
    "threadgroup_position_in_grid": "kTgPos",
    "threads_per_threadgroup": "kTgSize",
    "threadgroups_per_grid": "kNGroups",
    "threads_per_grid": "kGridSize",
    "thread_index_in_threadgroup": "kIndexInTg",
    "thread_index_in_simdgroup": "kLane",
    "simdgroup_index_in_threadgroup": "kSimdgroup",
    "threads_per_simdgroup": "kSimdWidth",
    "thread_execution_width": "kSimdWidth",
    "simdgroups_per_threadgroup": "kNSimdgroups",
}


class MetalSourceError(ValueError):
    """A .metal file uses a construct the emulator refuses (with file:line)."""


_COMMENT_OR_STRING = re.compile(
    r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'", re.S
)


def strip_comments(text: str) -> str:
    """Replaces comments by spaces, keeping every other character in place.

    The result has the same length and the same newlines as ``text``, so
    offsets found in it are offsets in the original.
    """

    def blank(m: re.Match[str]) -> str:
        s = m.group(0)
        if s.startswith(("//", "/*")):
            return "".join(c if c == "\n" else " " for c in s)
        return s

    return _COMMENT_OR_STRING.sub(blank, text)


def line_of(text: str, pos: int) -> int:
    """1-based line number of offset ``pos``."""
    return text.count("\n", 0, pos) + 1


@dataclass
class Param:
    """One kernel parameter: declaration text split into type and name, plus attributes."""

    type: str
    name: str
    attrs: list[tuple[str, str | None]]  # (attribute name, argument text or None)
    line: int

    @property
    def buffer_index(self) -> int | None:
        """The n of ``[[buffer(n)]]``, when it is an integer literal."""
        for name, arg in self.attrs:
            if name == "buffer" and arg is not None and arg.strip().isdigit():
                return int(arg)
        return None

    @property
    def threadgroup_index(self) -> int | None:
        """The n of ``[[threadgroup(n)]]``, when it is an integer literal."""
        for name, arg in self.attrs:
            if name == "threadgroup" and arg is not None and arg.strip().isdigit():
                return int(arg)
        return None

    @property
    def struct_name(self) -> str | None:
        """For a reference parameter (``constant P& p``), the referenced type name."""
        m = re.search(r"([A-Za-z_]\w*)\s*&\s*$", self.type)
        return m.group(1) if m else None


@dataclass
class KernelDef:
    """A ``[[kernel]]`` function definition."""

    name: str
    params: list[Param]
    templated: bool
    line: int
    body_start: int  # offset of '{'
    body_end: int  # offset just past the matching '}'


@dataclass
class ParamsStruct:
    """A struct whose fields are all 4-byte scalars (the subset's Params)."""

    name: str
    fields: list[tuple[str, str]]  # (type, name)
    line: int


@dataclass
class MetalSource:
    """What the harness and the lint need to know about one .metal file."""

    path: Path
    text: str
    stripped: str
    kernels: dict[str, KernelDef] = field(default_factory=dict)
    # entry point name -> (kernel function, C++ expression naming the function to call)
    entries: dict[str, tuple[KernelDef, str]] = field(default_factory=dict)
    structs: dict[str, ParamsStruct] = field(default_factory=dict)
    instantiation_spans: list[tuple[int, int]] = field(default_factory=list)


_KERNEL = re.compile(r"(?:\[\[\s*kernel\s*\]\]|\bkernel\b)\s+(\w+)\s+([A-Za-z_]\w*)\s*\(")
_TEMPLATE_TAIL = re.compile(r"template\s*<[^;{}]*>\s*$")
_INSTANTIATION = re.compile(
    r"template\s*\[\[\s*host_name\s*\(\s*\"(?P<host>[^\"]+)\"\s*\)\s*\]\]\s*"
    r"\[\[\s*kernel\s*\]\]\s*decltype\s*\(\s*(?P<decl>[^;]*?)\s*\)\s*(?P<target>[^;]*?)\s*;"
)
_ATTR = re.compile(r"\[\[\s*([A-Za-z_]\w*)\s*(?:\(([^()]*)\))?\s*\]\]")
_STRUCT = re.compile(r"\bstruct\s+([A-Za-z_]\w*)\s*\{([^{}]*)\}\s*;")
_FOUR_BYTE = {
    "int": "<i4",
    "int32_t": "<i4",
    "uint": "<u4",
    "uint32_t": "<u4",
    "unsigned": "<u4",
    "unsigned int": "<u4",
    "float": "<f4",
}


def four_byte_dtype(type_name: str) -> str | None:
    """numpy dtype string of a 4-byte scalar field type, or None."""
    return _FOUR_BYTE.get(" ".join(type_name.split()))


def _matching(text: str, open_pos: int, open_ch: str, close_ch: str) -> int:
    """Offset just past the bracket that closes the one at ``open_pos``."""
    depth = 0
    for i in range(open_pos, len(text)):
        c = text[i]
        if c == open_ch:
            depth += 1
        elif c == close_ch:
            depth -= 1
            if depth == 0:
                return i + 1
    raise MetalSourceError(f"unbalanced {open_ch!r} at offset {open_pos}")


def _split_params(text: str) -> list[tuple[str, int]]:
    """Splits a parameter list at top-level commas; returns (text, offset) pairs."""
    out: list[tuple[str, int]] = []
    depth = 0
    start = 0
    for i, c in enumerate(text):
        if c in "([<":
            depth += 1
        elif c in ")]>":
            depth -= 1
        elif c == "," and depth == 0:
            out.append((text[start:i], start))
            start = i + 1
    if text[start:].strip():
        out.append((text[start:], start))
    return out


def _parse_param(text: str, line: int) -> Param:
    attrs = [(m.group(1), m.group(2)) for m in _ATTR.finditer(text)]
    decl = _ATTR.sub(" ", text).strip()
    m = re.search(r"([A-Za-z_]\w*)\s*$", decl)
    name = m.group(1) if m else ""
    ptype = decl[: m.start()].strip() if m else decl
    return Param(type=" ".join(ptype.split()), name=name, attrs=attrs, line=line)


def parse_source(text: str, path: str | Path = "<string>") -> MetalSource:
    """Finds kernels, instantiations and 4-byte-field structs in ``text``."""
    stripped = strip_comments(text)
    src = MetalSource(path=Path(path), text=text, stripped=stripped)
    for m in _STRUCT.finditer(stripped):
        fields: list[tuple[str, str]] = []
        ok = True
        for decl in m.group(2).split(";"):
            decl = " ".join(decl.split())
            if not decl:
                continue
            fm = re.fullmatch(r"(.+?)\s+([A-Za-z_]\w*)", decl)
            if not fm or four_byte_dtype(fm.group(1)) is None:
                ok = False
                fields.append((decl, ""))
                continue
            fields.append((fm.group(1), fm.group(2)))
        if ok:
            src.structs[m.group(1)] = ParamsStruct(m.group(1), fields, line_of(text, m.start()))
    for m in _KERNEL.finditer(stripped):
        name = m.group(2)
        open_pos = m.end() - 1
        close = _matching(stripped, open_pos, "(", ")")
        params = []
        for ptext, off in _split_params(stripped[open_pos + 1 : close - 1]):
            params.append(_parse_param(ptext, line_of(text, open_pos + 1 + off)))
        body = stripped.find("{", close)
        body_end = _matching(stripped, body, "{", "}") if body >= 0 else close
        templated = bool(_TEMPLATE_TAIL.search(stripped[max(0, m.start() - 300) : m.start()]))
        kd = KernelDef(name, params, templated, line_of(text, m.start()), body, body_end)
        src.kernels[name] = kd
        if not templated:
            src.entries[name] = (kd, name)
    for m in _INSTANTIATION.finditer(stripped):
        target = " ".join(m.group("target").split())
        fname_m = re.match(r"[A-Za-z_]\w*", target)
        line = line_of(text, m.start())
        if not fname_m or fname_m.group(0) not in src.kernels:
            raise MetalSourceError(f"{path}:{line}: instantiation of unknown kernel {target!r}")
        if " ".join(m.group("decl").split()) != target:
            raise MetalSourceError(
                f"{path}:{line}: decltype({m.group('decl')}) must name the instantiated {target}"
            )
        src.entries[m.group("host")] = (src.kernels[fname_m.group(0)], target)
        src.instantiation_spans.append((m.start(), m.end()))
    return src


# Statement-initial threadgroup declaration: one name, optional array dims, no initialiser.
_TG_DECL = re.compile(
    r"(?m)(?:^|(?<=[;{}]))(?P<lead>[ \t]*)threadgroup[ \t]+"
    r"(?P<type>(?:const[ \t]+)?[A-Za-z_][\w:]*(?:[ \t]*<[^;{}()\n]*?>)?)[ \t]+"
    r"(?P<name>[A-Za-z_]\w*)[ \t]*(?P<dims>(?:\[[^\[\];\n]+\][ \t]*)*);"
)
_TG_STATEMENT = re.compile(r"(?m)(?:^|(?<=[;{}]))[ \t]*threadgroup\b(?P<rest>[^;{]*)")
_TG_PARAM_ATTR = re.compile(r"\[\[\s*threadgroup\s*\(")
_POSITION_ATTR = re.compile(r"\[\[\s*(" + "|".join(POSITION_ATTRIBUTES) + r")\s*\]\]")
# `constant T*` with an optional leading or trailing const: the pointee type T.
_CONSTANT_PTR = re.compile(
    r"\b(?P<c1>const\s+)?constant\s+(?P<c2>const\s+)?(?P<type>[A-Za-z_][\w:]*)\s*\*"
)


def prepass(src: MetalSource) -> str:
    """Returns the C++ translation unit text for ``src`` (see the module docstring)."""
    text = src.text
    stripped = src.stripped
    edits: list[tuple[int, int, str]] = []

    for start, end in src.instantiation_spans:
        edits.append((start, end, "".join(c if c == "\n" else " " for c in text[start:end])))

    for m in _TG_DECL.finditer(stripped):
        ty = m.group("type").strip()
        dims = "".join(m.group("dims").split())
        full = f"{ty}{dims}"
        repl = (
            f"{m.group('lead')}::mtl_emu::tg_ref<{full}> {m.group('name')} = "
            f"::mtl_emu::tg_array<{full}>(MTL_EMU_TG_SITE, __FILE__, __LINE__);"
        )
        edits.append((m.start(), m.end(), repl))

    tg_decl_starts = {m.start() for m in _TG_DECL.finditer(stripped)}
    for m in _TG_STATEMENT.finditer(stripped):
        if m.start() in tg_decl_starts:
            continue
        rest = m.group("rest")
        if "*" in rest or "&" in rest:
            continue  # a pointer or reference into threadgroup memory: the keyword is dropped
        line = line_of(text, m.start())
        raise MetalSourceError(
            f"{src.path}:{line}: unsupported threadgroup declaration; write exactly one "
            "'threadgroup T name[dims];' per statement, without an initialiser"
        )

    for m in _TG_PARAM_ATTR.finditer(stripped):
        edits.append((m.start(), m.end(), "[[mtl_emu_threadgroup_param("))

    for m in _POSITION_ATTR.finditer(stripped):
        edits.append((m.start(), m.end(), f"[[MTL_EMU_POS({POSITION_ATTRIBUTES[m.group(1)]})]]"))

    for m in _CONSTANT_PTR.finditer(stripped):
        const = "const " if m.group("c1") or m.group("c2") else ""
        edits.append((m.start(), m.end(), f"::mtl_emu::constant_ptr<{const}{m.group('type')}>"))

    edits.sort()
    out: list[str] = []
    pos = 0
    for start, end, repl in edits:
        if start < pos:
            raise MetalSourceError(f"{src.path}: overlapping rewrites at offset {start}")
        out.append(text[pos:start])
        out.append(repl)
        pos = end
    out.append(text[pos:])
    body = "".join(out)

    regs = [
        f'MTL_EMU_REGISTER(mtl_emu_kernel_{i}, "{name}", {call})'
        for i, (name, (_, call)) in enumerate(sorted(src.entries.items()))
    ]
    path = str(src.path).replace("\\", "\\\\").replace('"', '\\"')
    return (
        '#include "metal_shim.h"\n'
        f'#line 1 "{path}"\n'
        f"{body}\n"
        '#line 1 "<emulator kernel registrations>"\n' + "\n".join(regs) + "\n"
    )


_LOCAL_INCLUDE = re.compile(r'(?m)^\s*#\s*include\s*"([^"]+)"')


def local_includes(path: Path, text: str, seen: set[Path] | None = None) -> list[Path]:
    """Project headers included with quotes, recursively (resolved next to the includer)."""
    seen = set() if seen is None else seen
    found: list[Path] = []
    for m in _LOCAL_INCLUDE.finditer(strip_comments(text)):
        p = (path.parent / m.group(1)).resolve()
        if p in seen or not p.is_file():
            continue
        seen.add(p)
        found.append(p)
        found.extend(local_includes(p, p.read_text(), seen))
    return found
