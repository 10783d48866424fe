"""The default SFT set's tools: their OpenAI declarations and their implementations.

Three tools, kept tiny because their declarations are rendered into every conversation:
- `calculator(expression)`: + - * and parentheses over numbers, evaluated from the `ast`, never `eval`;
- `lookup(key)`: a made-up fact from a bundled table, keyed "<fact> of <place>" (e.g. "colour of Bosk"),
  so that no pretraining corpus knows the answer and the model has to call the tool;
- `convert(value, from, to)`: between km/m/cm/mm, kg/g/mg, days/hours/minutes/seconds.
`call_tool` runs one call and returns the result as a string; a bad call gives an "error: ..." string
instead of raising, so an agent loop can hand the error back to the model.
"""
from __future__ import annotations

import ast
import hashlib
import json
import math
from fractions import Fraction

from k3.text.tool_schema import compile_parameters


def _declare(name: str, description: str, properties: dict[str, dict]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": list(properties),
                       "additionalProperties": False}}}


TOOLS: list[dict] = [
    _declare("calculator", "Compute + - * of numbers.", {"expression": {"type": "string"}}),
    _declare("lookup", "Look up a fact.", {"key": {"type": "string"}}),
    _declare("convert", "Convert units.", {"value": {"type": "number"}, "from": {"type": "string"},
                                           "to": {"type": "string"}}),
]
TOOL_NAMES = tuple(t["function"]["name"] for t in TOOLS)

# made-up places: names no corpus knows (short, so that copying them into a call costs few tokens).
# Many of them: with a few dozen a model answers a place it has not seen with one it memorized (the
# cheaper fit on a small closed set); with a thousand, copying the asked name is what fits.
NAMED_PLACES = ("Abrel", "Bosk", "Carth", "Dunmo", "Elvar", "Fenra", "Gorva", "Hesk", "Ivel", "Jorn", "Kelo", "Lunt",
                "Morv", "Nesh", "Orla", "Pell", "Quist", "Ravn", "Selk", "Tovra", "Ubra", "Vask", "Wenl", "Xara",
                "Yorl", "Zamt", "Brel", "Crom", "Drev", "Fosk", "Grel", "Heln")
NUM_PLACES = 1000
FACTS = ("colour", "population", "code")
COLOURS = ("red", "blue", "green", "teal", "amber", "grey", "violet", "gold", "white", "black", "pink", "brown")


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def _fact(place: str, fact: str) -> str:
    h = _digest(f"k3-sft-table|{place}|{fact}")
    if fact == "colour":
        return COLOURS[h % len(COLOURS)]
    if fact == "population":
        return str(100 + h % 9900)
    return f"{place[:2].upper()}{10 + h % 90}"  # e.g. "BO47"


def _made_up_places(n: int) -> tuple[str, ...]:
    """NAMED_PLACES, then syllable names (consonants + vowel + ending, once or twice) up to `n`,
    drawn from fixed hashes: the same on every machine."""
    onsets = ("b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
              "br", "cr", "dr", "gr", "kr", "tr", "st", "sk")
    endings = ("", "n", "r", "l", "m", "t", "v", "sk", "rn", "lt")
    names, i = list(NAMED_PLACES), 0
    while len(names) < n:
        h, i = _digest(f"k3-sft-place|{i}"), i + 1
        syllables = 1 + h % 2
        name = ""
        for _ in range(syllables):
            h //= 2
            name += onsets[h % len(onsets)] + "aeiou"[h // 26 % 5] + endings[h // 130 % len(endings)]
            h //= 1300
        name = name.capitalize()
        if 4 <= len(name) <= 8 and name not in names:
            names.append(name)
    return tuple(names)


PLACES = _made_up_places(NUM_PLACES)


def lookup_key(fact: str, place: str) -> str:
    return f"{fact} of {place}"


# the bundled table, derived from fixed hashes: the same on every machine and every run
TABLE: dict[str, str] = {lookup_key(f, p): _fact(p, f) for p in PLACES for f in FACTS}
_BY_KEY = {k.lower(): v for k, v in TABLE.items()}  # lookups ignore case and repeated spaces

# each unit in its dimension's base unit (metre, gram, second); exact, so results print without float noise
UNITS: dict[str, tuple[str, Fraction]] = {
    "km": ("length", Fraction(1000)), "m": ("length", Fraction(1)), "cm": ("length", Fraction(1, 100)),
    "mm": ("length", Fraction(1, 1000)),
    "kg": ("mass", Fraction(1000)), "g": ("mass", Fraction(1)), "mg": ("mass", Fraction(1, 1000)),
    "days": ("time", Fraction(86400)), "hours": ("time", Fraction(3600)), "minutes": ("time", Fraction(60)),
    "seconds": ("time", Fraction(1)),
}

MAX_EXPRESSION = 200  # characters: the calculator is for small arithmetic, not a compute service
MAX_MAGNITUDE = 10**15


class ToolError(ValueError):
    """A call that cannot be carried out; call_tool turns it into an "error: ..." result."""


def format_number(x: float | Fraction) -> str:
    """Integers without a decimal point; other values to at most 6 decimals, trailing zeros dropped."""
    x = Fraction(x)
    if x.denominator == 1:
        return str(x.numerator)
    text = f"{float(x):.6f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def _number(value: float) -> Fraction:
    """Exact value of a JSON or Python number (a float by its decimal text, so 0.1 stays 0.1)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError(f"{value} is not a finite number")
    return Fraction(repr(value)) if isinstance(value, float) else Fraction(value)


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        v = _number(node.value)
        if abs(v) > MAX_MAGNITUDE:
            raise ToolError("number too large")
        return v
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        a, b = _eval(node.left), _eval(node.right)
        v = a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
        if abs(v) > MAX_MAGNITUDE:
            raise ToolError("result too large")
        return v
    raise ToolError("only numbers, + - * and parentheses are allowed")


def calculator(expression: str) -> str:
    if len(expression) > MAX_EXPRESSION:
        raise ToolError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.replace("×", "*").replace("−", "-").strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expression!r}") from None
    return format_number(_eval(tree))


def lookup(key: str) -> str:
    value = _BY_KEY.get(" ".join(key.split()).lower())
    if value is None:
        raise ToolError(f"no entry for {key!r}")
    return value


def convert(value: float, from_unit: str, to_unit: str) -> str:
    if from_unit not in UNITS or to_unit not in UNITS:
        bad = from_unit if from_unit not in UNITS else to_unit
        raise ToolError(f"unknown unit {bad!r} (known: {', '.join(UNITS)})")
    (dim_a, fa), (dim_b, fb) = UNITS[from_unit], UNITS[to_unit]
    if dim_a != dim_b:
        raise ToolError(f"cannot convert {dim_a} ({from_unit}) to {dim_b} ({to_unit})")
    return f"{format_number(_number(value) * fa / fb)} {to_unit}"


_VALIDATORS = {t["function"]["name"]: compile_parameters(t["function"]["parameters"]) for t in TOOLS}


def parse_arguments(arguments: dict | str) -> dict:
    """A call's arguments as a dict: a JSON string (OpenAI's shape) or an already-parsed dict."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ToolError(f"arguments are not valid JSON ({e.msg})") from None
    if not isinstance(arguments, dict):
        raise ToolError("arguments must be a JSON object")
    return arguments


def call_tool(name: str, arguments: dict | str) -> str:
    """Run one call of a default tool; the result, or "error: ..." for a bad call (never raises)."""
    try:
        if not isinstance(name, str) or name not in _VALIDATORS:
            raise ToolError(f"unknown tool {name!r} (known: {', '.join(TOOL_NAMES)})")
        args = parse_arguments(arguments)
        problem = next(iter(_VALIDATORS[name].iter_errors(args)), None)
        if problem is not None:
            raise ToolError(f"invalid arguments: {problem.message}")
        if name == "calculator":
            return calculator(args["expression"])
        if name == "lookup":
            return lookup(args["key"])
        return convert(args["value"], args["from"], args["to"])
    except ToolError as e:
        return f"error: {e}"
    except RecursionError:
        return "error: expression nested too deeply"
