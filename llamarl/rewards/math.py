"""MATH reward (LlamaRL's "sympy score"): extract a completion's final answer, check symbolic equivalence.

Extraction (``extract_answer``), first match wins:

1. the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces honoured),
2. the last "the (final) answer is X" / "Final Answer: X" (to the end of the line, ``$`` and a
   trailing period stripped),
3. the last ``$...$`` / ``\\(...\\)`` / ``\\[...\\]`` math span,
4. the last number in the text.

Equivalence (``is_equiv``): both answers are normalised (``normalize``: ``\\left``/``\\right``,
``\\dfrac``/``\\tfrac``, spacing commands, ``^\\circ``, ``\\%``, ``\\$``, trailing ``\\text{}``
units, thousands separators, a leading ``x =``); equal strings score 1. Otherwise they are split
into parts (tuples / intervals / lists / ``\\cup``), compared part by part (bracket types must
match: ``(1, 2]`` is not ``[1, 2]``; plain comma lists of solutions are compared as multisets),
and each part pair is checked with sympy: the LaTeX is translated to a sympy expression by a small
whitelisting translator (``to_sympy``: ``\\frac``, ``\\sqrt``, ``\\sqrt[n]``, ``\\pi``,
``\\infty``, ``^``, ``\\cdot``, implicit multiplication, ...), then ``simplify(a - b) == 0`` or,
for numbers, equality of their values to 1e-9 relative. Near misses (``0.33`` vs ``1/3``,
``\\sqrt{3}`` vs ``3``) score 0.

Backend: ``math_verify`` (Hugging Face's Math-Verify) is used first where it is installed and
``backend="auto"``; a pair it rejects is still checked by the sympy rules above, so installing it
can only add matches. ``backend="sympy"`` never uses it (the tests pin this).

Safety and time: model output is never ``eval``-ed as written. ``to_sympy`` admits only digits,
single-letter symbols, operators and a fixed set of function names before handing the string to
``sympy.parse_expr``, rejects huge exponents / literals (a big-int ``9**9**9`` cannot be
interrupted), and every sympy comparison runs under a per-call ``timeout_s`` (SIGALRM, on the main
thread; elsewhere the reward pool's per-sample timeout is the guard). A timeout scores 0.
"""

from __future__ import annotations

import contextlib
import functools
import re
import signal
import threading
from collections import Counter
from collections.abc import Iterator

from llamarl.data.boxed import boxed_contents, braced

DEFAULT_TIMEOUT_S = 2.0
_MAX_EXPR_CHARS = 300
_MAX_EXPONENT = 400
_MAX_LITERAL_DIGITS = 60

# ----------------------------------------------------------------------------- extraction


_ANSWER_IS_RE = re.compile(r"(?:the\s+)?(?:final\s+)?answer\s*(?:is|:)\s*:?\s*([^\n]+)", re.IGNORECASE)
_MATH_SPAN_RE = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
_NUMBER_RE = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?|-?\.\d+")


def _strip_span(span: str) -> str:
    span = span.strip()
    inner = _MATH_SPAN_RE.fullmatch(span)
    if inner:
        span = next(g for g in inner.groups() if g is not None)
    span = span.strip().strip("$").strip()
    return re.sub(r"[.\s]+$", "", span)


def extract_answer(text: str) -> str | None:
    """The final answer in ``text`` as a (LaTeX) string, or None; rules in the module docstring."""
    boxed = boxed_contents(text)
    if boxed:
        return boxed[-1].strip()
    answers = _ANSWER_IS_RE.findall(text)
    if answers:
        span = answers[-1]
        inline = _MATH_SPAN_RE.search(span)
        span = next(g for g in inline.groups() if g is not None) if inline else span
        if (span := _strip_span(span)):
            return span
    spans = [next(g for g in m.groups() if g is not None) for m in _MATH_SPAN_RE.finditer(text)]
    if spans and (span := _strip_span(spans[-1])):
        return span
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


def reference_answer(reference: str) -> str:
    """The answer a reference stands for: its last ``\\boxed{}`` if it has one (a full MATH
    solution), else the whole string (a bare answer, as in MATH-500's ``answer`` field)."""
    boxed = boxed_contents(reference)
    return boxed[-1].strip() if boxed else reference.strip()


# ----------------------------------------------------------------------------- normalisation

_UNIT_WORDS = (
    "degrees?|cm|centimeters?|meters?|m|km|inches?|inch|feet|foot|ft|units?|sq|square|cubic|dollars?|cents?"
    "|hours?|minutes?|seconds?|days?|weeks?|years?|mph|miles?|pounds?|ounces?|grams?|kg|liters?|points?"
)


def _replace_command_arg(text: str, command: str, fmt: str) -> str:
    """Replace every ``\\command{arg}`` by ``fmt.format(arg)`` (nested braces honoured)."""
    out, i = [], 0
    pattern = "\\" + command
    while (j := text.find(pattern, i)) != -1:
        end = j + len(pattern)
        if end < len(text) and text[end].isalpha():  # a longer command name, e.g. \textbf vs \text
            out.append(text[i:end])
            i = end
            continue
        group = braced(text, end)
        if group is None:
            out.append(text[i:end])
            i = end
            continue
        out.append(text[i:j] + fmt.format(group[0]))
        i = group[1]
    out.append(text[i:])
    return "".join(out)


def normalize(answer: str) -> str:
    """A canonical string form of a LaTeX answer (for the exact-match fast path and parsing).

    Removes presentation-only LaTeX, units and degree signs, thousands separators and a leading
    single-variable ``x =``; turns ``\\dfrac``/``\\tfrac`` into ``\\frac`` and ``\\frac12`` into
    ``\\frac{1}{2}``; lower-cases nothing (``A`` and ``a`` may differ).
    """
    s = answer.strip()
    s = s.replace("\n", " ").replace("~", " ").replace("\\displaystyle", "")
    s = re.sub(r"(?<=\d)\\,(?=\d{3})", "", s)  # "1\\,000"
    s = re.sub(r"(?<!\\)\\[!,;: ]", " ", s)  # spacing commands, not the row break "\\\\"
    s = re.sub(r"\\left\s*|\\right\s*|\\big[lr]?|\\Big[lr]?", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = s.replace("\\le ", "\\leq ").replace("\\ge ", "\\geq ")
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "", s).replace("°", "")
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    # Trailing units: "5\text{ cm}", "10 \mbox{ inches}", "90^\circ", "12 cm^2".
    s = re.sub(r"\s*\\(?:text|textbf|mbox|mathrm)\{\s*(?:" + _UNIT_WORDS + r")(?:\^?\{?\d\}?)?\s*\}\s*$", "", s)
    s = re.sub(r"(?<=[\d}])\s*(?:" + _UNIT_WORDS + r")(?:\^\{?\d\}?)?\s*$", "", s)
    s = _replace_command_arg(s, "textbf", "{}")
    s = _replace_command_arg(s, "mathbf", "{}")
    s = _replace_command_arg(s, "text", "{}")
    s = _replace_command_arg(s, "mbox", "{}")
    s = _replace_command_arg(s, "mathrm", "{}")
    s = re.sub(r"(?<=[\d}])\s*(?:" + _UNIT_WORDS + r")(?:\^\{?\d\}?)?\s*$", "", s.strip())
    # \frac12 -> \frac{1}{2}, \frac1{2} -> \frac{1}{2}, \sqrt2 -> \sqrt{2}
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\s*(\d)\s*\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\s*\{([^{}]*)\}\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt\s*(\d+|[a-zA-Z])", r"\\sqrt{\1}", s)
    # Thousands separators in a plain number: "1,000,000" -> "1000000" (not "1,2" tuples).
    s = re.sub(r"(?<![\d.])(\d{1,3}(?:,\d{3})+)(?![\d,])", lambda m: m.group(1).replace(",", ""), s)
    s = re.sub(r"^\s*[a-zA-Z]\s*(?:=|\\in\b)\s*", "", s)  # "x = 5" -> "5", "x \\in [1, 2]" -> "[1, 2]"
    s = re.sub(r"\s+", " ", s).strip().rstrip(".").strip()
    if s.startswith("0.") or not s:
        return s
    if re.fullmatch(r"-?\.\d+", s):  # ".5" -> "0.5"
        s = s.replace(".", "0.", 1)
    return s


# ----------------------------------------------------------------------------- LaTeX -> sympy

_FUNCTIONS = {"sqrt", "sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp", "pi", "oo",
              "asin", "acos", "atan", "sinh", "cosh", "tanh", "root", "Abs"}
_LATEX_WORDS = {
    "\\pi": " pi ", "\\infty": " oo ", "\\infinity": " oo ", "\\cdot": "*", "\\times": "*", "\\div": "/",
    "\\ln": " ln ", "\\log": " log ", "\\exp": " exp ", "\\sin": " sin ", "\\cos": " cos ", "\\tan": " tan ",
    "\\cot": " cot ", "\\sec": " sec ", "\\csc": " csc ", "\\arcsin": " asin ", "\\arccos": " acos ",
    "\\arctan": " atan ",
}


def _latex_to_python(s: str) -> str:
    """Translate the LaTeX of one scalar expression to sympy-parsable text (no validation)."""
    s = _replace_frac_sqrt(s)
    for word, repl in sorted(_LATEX_WORDS.items(), key=lambda kv: -len(kv[0])):
        s = re.sub(re.escape(word) + r"(?![a-zA-Z])", repl, s)
    s = re.sub(r"\|([^|]+)\|", r"Abs(\1)", s)
    s = s.replace("{", "(").replace("}", ")").replace("[", "(").replace("]", ")")
    s = s.replace("^", "**")
    return s


def _replace_frac_sqrt(s: str) -> str:
    """``\\frac{a}{b}`` -> ``((a)/(b))``, ``\\sqrt[n]{x}`` -> ``((x)**(1/(n)))``, ``\\sqrt{x}`` -> ``sqrt(x)``,
    innermost first, braces matched."""
    for _ in range(50):
        m = re.search(r"\\frac\s*\{", s)
        if m:
            num = braced(s, m.end() - 1)
            den = braced(s, num[1]) if num else None
            if num is None or den is None:
                raise ValueError("unbalanced \\frac")
            s = s[: m.start()] + f"(({_replace_frac_sqrt(num[0])})/({_replace_frac_sqrt(den[0])}))" + s[den[1]:]
            continue
        m = re.search(r"\\sqrt\s*\[([^\]]*)\]\s*\{", s)
        if m:
            arg = braced(s, m.end() - 1)
            if arg is None:
                raise ValueError("unbalanced \\sqrt")
            s = s[: m.start()] + f"(({_replace_frac_sqrt(arg[0])})**(1/({m.group(1)})))" + s[arg[1]:]
            continue
        m = re.search(r"\\sqrt\s*\{", s)
        if m:
            arg = braced(s, m.end() - 1)
            if arg is None:
                raise ValueError("unbalanced \\sqrt")
            s = s[: m.start()] + f"sqrt({_replace_frac_sqrt(arg[0])})" + s[arg[1]:]
            continue
        return s
    raise ValueError("expression too deeply nested")


@functools.cache
def _sympy():
    """``(sympy, parse_expr, transformations)``, imported on first use: sympy takes ~0.5 s to import,
    and every process that imports ``llamarl.rewards`` (each reward worker) would pay it otherwise."""
    import sympy
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    return sympy, parse_expr, standard_transformations + (implicit_multiplication_application, convert_xor)


def to_sympy(answer: str):
    """The sympy expression of one scalar LaTeX answer (already ``normalize``-d).

    Raises ValueError for anything outside the whitelist (unknown commands or multi-letter names,
    too long, huge exponents or literals) or that sympy cannot parse.
    """
    text = _latex_to_python(answer)
    if len(text) > _MAX_EXPR_CHARS:
        raise ValueError("expression too long")
    if "\\" in text or not re.fullmatch(r"[0-9a-zA-Z+\-*/().\s]*", text) or "__" in text:
        raise ValueError(f"not a plain expression: {answer!r}")
    for name in re.findall(r"[a-zA-Z]+", text):
        if len(name) > 1 and name not in _FUNCTIONS:
            raise ValueError(f"unknown name {name!r}")
    if re.search(rf"\d{{{_MAX_LITERAL_DIGITS + 1},}}", text):
        raise ValueError("literal too large")
    sympy, parse_expr, transformations = _sympy()
    local = {"ln": sympy.log, "e": sympy.E, "pi": sympy.pi, "oo": sympy.oo}
    try:
        expr = parse_expr(text, local_dict=local, transformations=transformations, evaluate=False)
    except Exception as exc:  # noqa: BLE001 - sympy raises many types for bad syntax
        raise ValueError(f"cannot parse {answer!r}: {type(exc).__name__}") from None
    _check_sizes(expr)
    return expr


def _check_sizes(expr) -> None:
    """Reject powers whose exponent is not a small number (their evaluation cannot be interrupted)."""
    sympy = _sympy()[0]
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Pow):
            exponent = node.exp
            if exponent.has(sympy.Pow) and not exponent.is_Rational and any(
                    isinstance(p, sympy.Pow) and p.exp.is_number and abs(p.exp) > 4 for p in
                    sympy.preorder_traversal(exponent)):
                raise ValueError("nested large exponent")
            if exponent.is_number and exponent.is_real is not False:
                with contextlib.suppress(TypeError, ValueError):
                    if abs(float(exponent)) > _MAX_EXPONENT:
                        raise ValueError("exponent too large")


# ----------------------------------------------------------------------------- comparison


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise _Timeout after ``seconds`` (SIGALRM; only on the main thread, else no limit)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def _raise(signum, frame):
        raise _Timeout

    previous = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _split_top_level(s: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` outside any ()[]{} nesting."""
    parts, depth, current = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts]


def _structure(s: str) -> tuple[str, list[str]]:
    """Split a normalised answer into (kind, parts).

    kind: ``"union"`` (parts are intervals joined by ``\\cup``), ``"(]"``-style bracket pairs for
    tuples / intervals, ``"matrix"`` (rows joined), ``"list"`` (a bare comma list, order-free),
    ``"scalar"``.
    """
    s = s.strip()
    if "\\cup" in s:
        return "union", [p.strip() for p in s.split("\\cup")]
    matrix = re.fullmatch(r"\\begin\{[pbv]?matrix\}(.*)\\end\{[pbv]?matrix\}", s, re.DOTALL)
    if matrix:
        rows = [r.strip() for r in matrix.group(1).split("\\\\") if r.strip()]
        return "matrix", [c.strip() for r in rows for c in r.split("&")] + [f"#rows={len(rows)}"]
    if s.startswith("\\{") and s.endswith("\\}"):
        return "list", _split_top_level(s[2:-2])
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _balanced_outer(s):
        parts = _split_top_level(s[1:-1])
        if len(parts) > 1:
            return s[0] + s[-1], parts
    parts = _split_top_level(s)
    if len(parts) > 1:
        return "list", parts
    return "scalar", [s]


def _balanced_outer(s: str) -> bool:
    """Whether s[0] and s[-1] enclose the whole string (not "(1)+(2)")."""
    depth = 0
    for i, ch in enumerate(s):
        depth += 1 if ch in "([{" else -1 if ch in ")]}" else 0
        if depth == 0 and i < len(s) - 1:
            return False
    return depth == 0


def _scalar_equiv(a: str, b: str) -> bool:
    """Symbolic equality of two normalised scalar answers (string match, then sympy)."""
    if a == b:
        return True
    if a.replace(" ", "") == b.replace(" ", ""):
        return True
    try:
        x, y = to_sympy(a), to_sympy(b)
    except ValueError:
        return _plain_text(a) == _plain_text(b) and _plain_text(a) != ""
    if x == y:
        return True
    sympy = _sympy()[0]
    x, y = sympy.simplify(x), sympy.simplify(y)
    if x == y:
        return True
    if x.is_number and y.is_number:
        if x.has(sympy.oo, -sympy.oo, sympy.zoo) or y.has(sympy.oo, -sympy.oo, sympy.zoo):
            return x == y
        vx, vy = complex(sympy.N(x, 30)), complex(sympy.N(y, 30))
        return abs(vx - vy) <= 1e-9 * max(1.0, abs(vy))
    return sympy.simplify(x - y) == 0


def _plain_text(s: str) -> str:
    """A text answer compared as text: "(B)" / "\\text{(B)}" / "B" -> "b"."""
    return re.sub(r"[^a-z0-9]", "", s.lower())


def _parts_equiv(xs: list[str], ys: list[str], *, ordered: bool) -> bool:
    if len(xs) != len(ys):
        return False
    if ordered:
        return all(_scalar_equiv(x, y) for x, y in zip(xs, ys))
    remaining = list(ys)
    for x in xs:
        match = next((i for i, y in enumerate(remaining) if _scalar_equiv(x, y)), None)
        if match is None:
            return False
        remaining.pop(match)
    return True


def _sympy_equiv(prediction: str, reference: str) -> bool:
    a, b = normalize(prediction), normalize(reference)
    if a == b:
        return bool(a)
    kind_a, parts_a = _structure(a)
    kind_b, parts_b = _structure(b)
    if kind_a == "union" and kind_b == "union":
        return len(parts_a) == len(parts_b) and all(_sympy_equiv(x, y) for x, y in zip(parts_a, parts_b))
    if kind_a == "list" and kind_b == "list":
        return Counter(parts_a) == Counter(parts_b) or _parts_equiv(parts_a, parts_b, ordered=False)
    if kind_a != kind_b:
        return False
    if kind_a == "matrix":
        return parts_a[-1] == parts_b[-1] and _parts_equiv(parts_a[:-1], parts_b[:-1], ordered=True)
    return _parts_equiv(parts_a, parts_b, ordered=True)


def _math_verify_equiv(prediction: str, reference: str) -> bool:
    try:
        from math_verify import parse, verify  # optional dependency
    except ImportError:
        return False
    try:
        return bool(verify(parse(f"${reference}$"), parse(f"${prediction}$")))
    except Exception:  # noqa: BLE001 - math_verify failures fall back to the sympy rules
        return False


def is_equiv(prediction: str, reference: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
             backend: str = "auto") -> bool:
    """Whether two answer strings are mathematically equivalent (rules in the module docstring).

    ``backend``: ``"auto"`` (math_verify first where installed, then sympy) or ``"sympy"``. A
    comparison that runs past ``timeout_s`` or fails is False, never an exception.
    """
    if backend not in ("auto", "sympy"):
        raise ValueError(f"backend must be 'auto' or 'sympy', got {backend!r}")
    sympify_error = _sympy()[0].SympifyError  # imported outside the time limit
    try:
        with _time_limit(timeout_s):
            if backend == "auto" and _math_verify_equiv(prediction, reference):
                return True
            return _sympy_equiv(prediction, reference)
    except (_Timeout, RecursionError, ValueError, TypeError, ArithmeticError, AttributeError,
            sympify_error, NotImplementedError):
        return False


def score(completion: str, reference: str) -> float:
    """1.0 if the completion's final answer is equivalent to the reference's, else 0.0.

    ``reference`` is either a bare answer (``"\\frac{1}{2}"``) or a full solution ending in
    ``\\boxed{...}``.
    """
    found = extract_answer(completion)
    if found is None:
        return 0.0
    return 1.0 if is_equiv(found, reference_answer(reference)) else 0.0
