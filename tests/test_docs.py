"""The documents against the code (README.md and docs/).

- Each default is stated once, in docs/api.md's table (the block between ``<!-- BEGIN
  GENERATED: defaults -->`` and its end), made here from ``AccoOptimizer.__init__``'s signature
  and acco/options.py; ``python tests/test_docs.py --write`` rewrites it after a change.
- Anywhere else a default is stated inside a link to that table, ``[`name=value`](api.md#defaults)``,
  and checked against the code. A sentence that says "default" beside a keyword's value and is
  not such a link fails, unless it is history labelled with its date ("the defaults of
  2026-11-25") or another library's default.
- Every ``python ...`` / ``torchrun ...`` command names a file that exists, and that file's
  argparse parser accepts the command's flags and values.
- Every figure the top README quotes is found in a results file (benchmarks/results/) or in a
  table of docs/ or the README that names the command it came from.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import enum
import functools
import inspect
import io
import json
import re
import runpy
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import acco
from acco import options
from acco.integrations.schedules import FRAMEWORK_PACING

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api.md"
DOCUMENTS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md")
BLOCK = re.compile(r"(<!-- BEGIN GENERATED: defaults -->\n).*?(<!-- END GENERATED: defaults -->)", re.S)
# [`name=value`](api.md#defaults), [`name=value`](docs/api.md#defaults) or [`name=value`](#defaults)
# [`pacing="lockstep"`](api.md#defaults "framework.pacing"): a title names the table's row where the text
# does not (the framework integrations' own default)
MARKED = re.compile(r'\[`([\w.]+)=([^`]+)`\]\((?:[\w./]*api\.md)?#defaults(?: "([\w.]+)")?\)')


# ----------------------------------------------------------------------------- the defaults, from the code


def render(value: Any) -> str:
    """A default as a user writes it in Python."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, datetime.timedelta):
        minutes, seconds = divmod(int(value.total_seconds()), 60)
        return f"timedelta(minutes={minutes})" if not seconds else f"timedelta(seconds={int(value.total_seconds())})"
    if isinstance(value, functools.partial):
        keywords = ", ".join(f"{k}={render(v)}" for k, v in value.keywords.items())
        return f"partial(torch.optim.{value.func.__name__}, {keywords})"
    return repr(value)


# What a keyword whose signature default is None means; None where the signature says it all.
MEANING = {
    "process_group": "torch.distributed's default group (one process where it is not initialised)",
    "layout": '`"flat"` for the element-wise torch optimizers, `"tensor"` for the others',
    "max_grad_norm": "no clipping",
    "param_dtype": "the model's dtype",
    "reduce_dtype": "`param_dtype`",
    "estimate_dtype": "the estimate round sends what the commit round does",
    "module": "`params` when it is a module",
    "outer_optimizer": "`acco.default_outer(sync_every)`, shown at the default `sync_every`; with `membership=` (elastic groups) `default_outer(sync_every, elastic=True)`: Nesterov lr 0.5, momentum 0.3",
    "overlap": "`\"estimate\"` with an outer optimizer linear in its gradient (SGD without dampening), "
               "`\"discard\"` with any other",
    "membership": "every replica of the process group, in every outer round",
    "sync_delay": "with `sync_every=\"auto\"` chosen with H each round: 0 (blocking, at the H where that waits "
                  "at most 4% of the time), or 1 (the round lands one inner step after its launch) where that "
                  "keeps H more than 4 steps smaller; with a fixed `sync_every`, and for elastic groups "
                  "(`membership=`), 0",
}


@dataclass(frozen=True)
class Default:
    name: str  # a keyword of AccoOptimizer, or outer_optimizer.lr and the like
    value: str  # as a user writes it: the signature's, or what None resolves to
    mode: str  # the modes that read it
    meaning: str = ""


def code_defaults() -> dict[str, Default]:
    """Every keyword-only argument of ``AccoOptimizer`` with its default, the default outer
    optimizer's hyper-parameters, and the framework integrations' pacing."""
    found: dict[str, Default] = {}
    for name, parameter in inspect.signature(acco.AccoOptimizer.__init__).parameters.items():
        if parameter.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        mode = f'`mode="{options.MODE_ONLY[name][0].value}"`' if name in options.MODE_ONLY else "every mode"
        value = parameter.default
        if name == "overlap" and value is None:
            value = options.DEFAULT_OVERLAP
        found[name] = Default(name, render(value), mode, MEANING.get(name, ""))
    outer = acco.default_outer(options.DEFAULT_SYNC_EVERY)
    found["outer_optimizer"] = Default("outer_optimizer", render(outer), '`mode="local"`', MEANING["outer_optimizer"])
    for key, value in outer.keywords.items():
        found[f"outer_optimizer.{key}"] = Default(f"outer_optimizer.{key}", render(value), '`mode="local"`')
    group = {**options.probe_defaults(torch.optim.AdamW, {}), "optimizer_class": torch.optim.AdamW}
    options.choose_fused(group, torch.device("cpu"), torch.float32)
    found["defaults.fused"] = Default(
        "defaults.fused", render(group["fused"]), "`sync`, `dpu`, `acco`",
        "`None` in torch's signatures: the base optimizer is built `fused=True` where it is one of torch's classes with a fused kernel, "
        "`**defaults` (or the group) give neither `fused` nor `foreach`, and torch's rule allows the master shard's "
        "device and dtype (shown: AdamW, fp32 on the CPU); otherwise torch's own default")
    found["framework.pacing"] = Default("framework.pacing", render(FRAMEWORK_PACING), '`mode="local"`',
                                        "`pacing` under `AccoTrainer`, `AccoStrategy` and `AccoFabricStrategy`")
    return found


def defaults_block() -> str:
    """docs/api.md's signature and table of defaults."""
    signature = inspect.signature(acco.AccoOptimizer.__init__)
    shown = []
    for name, parameter in signature.parameters.items():
        if name == "self":
            continue
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY:
            shown.append(f"{name}={render(parameter.default)}")
        elif parameter.kind is inspect.Parameter.VAR_KEYWORD:
            shown.append(f"**{name}")
        else:
            shown.append(name)
    lines, line = [], "AccoOptimizer("
    for i, item in enumerate(shown):
        piece = item + (", " if i < len(shown) - 1 else ")")
        if i == 2:
            piece = "*, " + piece
        if len(line) + len(piece) > 96:
            lines.append(line.rstrip())
            line = "    "
        line += piece
    lines.append(line)
    rows = ["| keyword | default | read in | what the default means |", "|---|---|---|---|"]
    for default in code_defaults().values():
        given = signature.parameters.get(default.name)
        meaning = default.meaning
        if given is not None and given.default is None and default.value != "None":
            meaning = f"`None` in the signature: {meaning}"
        rows.append(f"| `{default.name}` | `{default.value}` | {default.mode} | {meaning} |")
    return ("```python\n" + "\n".join(lines) + "\n```\n\n"
            "Made from the code by `python tests/test_docs.py --write` and checked by tests/test_docs.py. "
            "`outer_optimizer.lr` and the like are the hyper-parameters of the default outer optimizer at the "
            f"default `sync_every`; `framework.pacing` is the default of `pacing` under the framework "
            "integrations (their loops run collectives at step counts).\n\n" + "\n".join(rows) + "\n")


def write() -> None:
    text = API.read_text()
    if not BLOCK.search(text):
        raise SystemExit(f"{API}: no '<!-- BEGIN GENERATED: defaults -->' block")
    API.write_text(BLOCK.sub(lambda m: m.group(1) + defaults_block() + m.group(2), text))
    print(f"wrote the defaults block of {API}")


def test_api_md_states_the_code_defaults() -> None:
    """docs/api.md's block is what the code gives today (a default changed in options.py or the
    signature fails here until the block is rewritten)."""
    found = BLOCK.search(API.read_text())
    assert found, "docs/api.md has no defaults block"
    stated = found.group(0)[len(found.group(1)):-len(found.group(2))]
    assert stated == defaults_block(), \
        "docs/api.md's defaults differ from the code's: run `python tests/test_docs.py --write` and read the diff"


# ----------------------------------------------------------------------------- statements elsewhere


def prose(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, sentence) for the text outside fenced code and generated blocks; a sentence
    may run over lines."""
    text = path.read_text()
    text = re.sub(r"<!-- BEGIN GENERATED: (\S+) -->.*?<!-- END GENERATED: \1 -->",
                  lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    kept, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            kept.append("")
            continue
        kept.append("" if fenced else line)
    start, sentence = 1, []
    for number, line in enumerate(kept, 1):
        if not line.strip() or line.lstrip().startswith(("|", "#", "- ", "* ")) or re.match(r"\s*\d+\. ", line):
            if sentence:
                yield start, " ".join(sentence)
            sentence, start = [], number
            if not line.strip() or line.lstrip().startswith("#"):
                start = number + 1
                continue
        if not sentence:
            start = number
        pieces = re.split(r"(?<=[.;:])\s+(?=[A-Z(`])", line.strip())
        for piece in pieces[:-1]:
            sentence.append(piece)
            yield start, " ".join(sentence)
            sentence, start = [], number
        sentence.append(pieces[-1])
    if sentence:
        yield start, " ".join(sentence)


def same(stated: str, code: str) -> bool:
    def norm(value: str) -> str:
        return value.strip().replace("'", '"').replace(" ", "")
    return norm(stated) == norm(code)


def test_marked_defaults_match_the_code() -> None:
    """Each ``[`name=value`](api.md#defaults)`` in README.md and docs/ states the code's default."""
    defaults = code_defaults()
    wrong, seen = [], 0
    for path in DOCUMENTS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for text_name, value, row in MARKED.findall(line):
                name = row or text_name
                seen += 1
                where = f"{path.relative_to(ROOT)}:{number}"
                if name not in defaults:
                    wrong.append(f"{where}: `{name}` is no keyword of AccoOptimizer (docs/api.md#defaults)")
                elif not same(value, defaults[name].value):
                    wrong.append(f"{where}: `{name}={value}`, the code's default is {defaults[name].value}")
    assert seen, "no marked default anywhere: the pattern or the documents changed"
    assert not wrong, "\n".join(wrong)


# A sentence about history, or about another library's or a framework's own defaults.
# History, labelled with the date of the defaults it ran with: "(the defaults of 2026-11-25)".
HISTORY = re.compile(r"\bdefaults? (?:of|as of|before|until|on) 20\d\d-\d\d-\d\d", re.I)
ELSEWHERE = re.compile(r"torchft|DiLoCo's|prime|MaxText|OpenDiLoCo|nanoGPT|Hugging Face's|transformers'|Lightning's"
                       r"|torch's|FSDP2's|PyTorch's|argparse|the example's|the benchmark's", re.I)


NEAR = 40  # characters between "default" and a value it states


def stated_defaults(sentence: str, names: set[str]) -> list[str]:
    """The ``name=value`` pairs a sentence states as acco's defaults, outside marked links: a
    value within ``NEAR`` characters of the word "default", not just after another library's name."""
    if not re.search(r"\bdefaults?\b", sentence, re.I) or HISTORY.search(sentence):
        return []
    bare = MARKED.sub(lambda m: "#" * len(m[0]), sentence)  # marked: checked above, and still as far away
    near = [m.start() for m in re.finditer(r"\bdefaults?\b", bare, re.I)]
    others = [m.end() for m in ELSEWHERE.finditer(bare)]

    # A sentence that opens with "Defaults" states them all; elsewhere a value near the word
    reach = len(bare) if re.match(r"\W*defaults?\b", bare, re.I) else NEAR

    def ours(at: int, reach: int = reach) -> bool:
        def clause(a: int, b: int) -> bool:  # no ";" between
            return ";" not in bare[min(a, b):max(a, b)]
        return (any(abs(at - w) <= reach and clause(at, w) for w in near)
                and not any(0 <= at - w <= NEAR // 2 for w in others))
    patterns = (
        (r"`([\w.]+)=([^`]+)`", "{1}={2}"),
        (r"`(\w+)`[^`.;]{0,40}?\(default:? ([^),;]+)", "{1}={2}"),  # `name` ... (default 30)
        (r"`(\w+)` \(([^),;]+), default[;)]", "{1}={2}"),  # `name` (4, default; ...)
        (r"\blr[,=]? ?(\d?\.\d+)(?:,| /| and) ?momentum[,=]? ?(\d?\.\d+)", "outer lr={1}, momentum={2}"),
    )
    found = []
    for pattern, shown in patterns:
        for m in re.finditer(pattern, bare):
            outer = shown.startswith("outer")  # the outer optimizer's, anywhere in a sentence about defaults
            if (outer or m[1] in names) and ours(m.start(), len(bare) if outer else reach):
                found.append(shown.format(*[m[0], *m.groups()]))
    return found


def test_no_default_is_stated_outside_the_table() -> None:
    """A default stated in prose is a marked link (checked above), history that says so, or
    another library's; otherwise it drifts the day the code changes."""
    names = {name for name in code_defaults() if "." not in name}
    stray = []
    for path in DOCUMENTS:  # docs/api.md too: its table is a generated block, which prose() leaves out
        for number, sentence in prose(path):
            for pair in stated_defaults(sentence, names):
                stray.append(f"{path.relative_to(ROOT)}:{number}: {pair} in: {sentence[:160]}")
    assert not stray, ("defaults stated outside docs/api.md#defaults (write them as [`name=value`](api.md#defaults), "
                       "or say they are history):\n" + "\n".join(stray))


# ----------------------------------------------------------------------------- keywords


def calls(text: str, name: str) -> Iterator[str]:
    """Each ``name(...)`` call in ``text``, its parentheses balanced (``...`` placeholders
    kept: they parse as Python's Ellipsis)."""
    for found in re.finditer(rf"(?<![\w.]){re.escape(name)}\(", text):
        depth, end = 0, found.end() - 1
        for end in range(found.end() - 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        yield text[found.start():end + 1]


def keywords_of(call: str) -> tuple[list[str], str | None] | None:
    """The keywords a documented call passes, and its second positional argument's dotted name
    (an optimizer class); None where the text does not parse as one call."""
    import ast

    try:
        node = ast.parse(" ".join(call.split()), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call):
        return None
    second = ast.unparse(node.args[1]) if len(node.args) > 1 else None
    return [k.arg for k in node.keywords if k.arg is not None], second


def test_documented_calls_pass_keywords_that_exist() -> None:
    """Every ``AccoOptimizer(...)`` in README.md and docs/ passes keywords of its signature or
    of the optimizer class it names (its ``**defaults``), and every ``TorchFT.connect(...)`` /
    ``TorchFT(...)`` keywords of theirs."""
    from acco.elastic import TorchFT

    signatures = {"AccoOptimizer": inspect.signature(acco.AccoOptimizer.__init__).parameters,
                  "TorchFT.connect": inspect.signature(TorchFT.connect).parameters,
                  "TorchFT": inspect.signature(TorchFT.__init__).parameters}
    wrong, checked = [], 0
    for path in DOCUMENTS:
        text = path.read_text()
        for name, accepted in signatures.items():
            for call in calls(text, name):
                parsed = keywords_of(call)
                if parsed is None:
                    continue
                checked += 1
                passed, optimizer = parsed
                extra: set[str] = set()
                if name == "AccoOptimizer":  # the optimizer it names, or (elided) torch's usual ones
                    named = optimizer.split(".")[-1] if optimizer and optimizer.startswith("torch.optim.") else None
                    for cls in [getattr(torch.optim, named)] if named else [torch.optim.AdamW, torch.optim.SGD]:
                        extra |= set(inspect.signature(cls.__init__).parameters)
                unknown = [k for k in passed if k not in accepted and k not in extra]
                if unknown and not (name == "AccoOptimizer" and optimizer and not optimizer.startswith("torch.optim.")
                                    and optimizer != "..."):  # a class of the user's: its own keywords
                    wrong.append(f"{path.relative_to(ROOT)}: {name}(...) passes {unknown}: {' '.join(call.split())[:120]}")
    assert checked > 15, f"only {checked} documented calls parsed: the pattern or the documents changed"
    assert not wrong, "\n".join(wrong)


# ----------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class Command:
    where: str
    script: Path | None  # None: a module outside the repository (pytest, torchtitan)
    argv: list[str]


# Not scripts of this repository: the tools the documents run, and files a document writes itself.
OUTSIDE = {"pytest", "torch.distributed.run", "pip", "torchtitan.train", "coverage", "tensorboard"}
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*|.*\.\.\..*|<.*>|\$.*|\{.*\}|HOST:\d+)$")


def commands(path: Path) -> Iterator[Command]:
    """Every ``python ...`` and ``torchrun ...`` command of a document: in fenced shell blocks
    (continued lines joined, comments dropped) and in inline code."""
    text = path.read_text()
    written = set(re.findall(r"<!-- file: (\S+) -->", text))  # files the document's own code blocks are
    found: list[tuple[int, str]] = []
    fenced, language, pending, start = False, "", "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced, language = not fenced, line.strip()[3:]
            continue
        if fenced and language in ("", "bash", "sh", "shell", "console"):
            body = line.strip()
            if not pending:
                start = number
            if body.endswith("\\"):
                pending += body[:-1] + " "
                continue
            found.append((start, pending + body))
            pending = ""
        elif not fenced:
            found += [(number, code) for code in re.findall(r"`((?:sudo \S+ )?(?:\w+=\S+ )*(?:python|torchrun) [^`]+)`", line)]
    for number, line in found:
        line = re.sub(r"\s+#.*$", "", line.lstrip("$ ").strip())
        for part in re.split(r"\s*(?:&&|;|\|)\s*", line):
            try:
                words = shlex.split(part)
            except ValueError:
                continue
            while words and (re.match(r"^\w+=\S*$", words[0]) or words[0] in ("sudo", "time", "nohup", "env")
                             or words[0].startswith("$(")):
                words = words[1:]
                if words and words[0].endswith(")") and not words[0].startswith("$("):
                    words = words[1:]  # the rest of $(which python)
            if not words or words[0] not in ("python", "python3", "torchrun"):
                continue
            where = f"{path.relative_to(ROOT)}:{number}"
            rest = words[1:]
            if words[0] == "torchrun":  # its own flags come before the script
                while rest and rest[0].startswith("-"):
                    rest = rest[1:] if "=" in rest[0] or rest[0] == "--standalone" else rest[2:]
            if rest[:1] == ["-m"]:
                module = rest[1] if len(rest) > 1 else ""
                if module in OUTSIDE or not module:
                    yield Command(where, None, rest[2:])
                    continue
                candidate = ROOT / (module.replace(".", "/") + ".py")
                yield Command(where, candidate, rest[2:])
                continue
            if rest and rest[0].endswith(".py") and rest[0] not in written:
                yield Command(where, ROOT / rest[0], rest[1:])


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


@functools.cache
def parser_of(script: Path) -> argparse.ArgumentParser | str | None:
    """The script's argparse parser, caught when the script asks it to parse (nothing runs
    after that); None for a script that parses no arguments; what went wrong for a script that
    fails before it parses them."""
    originals = {name: getattr(argparse.ArgumentParser, name) for name in ("parse_args", "parse_known_args")}

    def catcher(name: str) -> Any:
        def catch(self: argparse.ArgumentParser, args: Any = None, *rest: Any, **kwargs: Any) -> Any:
            if args is not None and list(args) != sys.argv[1:]:  # a list the script made (another script's defaults)
                return originals[name](self, args, *rest, **kwargs)
            raise _Parsed(self)
        return catch
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(script), "--help"]
    sys.path[:0] = [str(script.parent), str(ROOT)]
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name in originals:
                patch.setattr(argparse.ArgumentParser, name, catcher(name))
            with contextlib.redirect_stdout(io.StringIO()):
                runpy.run_path(str(script), run_name="__main__")
    except _Parsed as parsed:
        return parsed.parser
    except SystemExit:
        return None
    except Exception as error:  # an import that no longer exists, ...
        return f"fails before it parses its arguments: {type(error).__name__}: {error}"
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return None


def refusal(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """What argparse says of ``argv`` (None: accepted). Placeholders (``SETTING``, ``...``)
    are not values to check: a command holding one has only its flags checked."""
    if any(PLACEHOLDER.match(word) for word in argv):
        known = set(parser._option_string_actions)
        unknown = [w.split("=")[0] for w in argv if w.startswith("-") and w.split("=")[0] not in known]
        return f"no flag {', '.join(unknown)}" if unknown else None
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as stop:
        return None if stop.code == 0 else errors.getvalue().strip().splitlines()[-1]
    return None


def documented_commands() -> list[Command]:
    return [command for path in DOCUMENTS for command in commands(path)]


def test_documented_commands_name_files_and_flags_that_exist() -> None:
    found = documented_commands()
    assert len(found) > 40, f"only {len(found)} commands found: the pattern or the documents changed"
    wrong = []
    for command in found:
        if command.script is None:
            continue
        if not command.script.is_file():
            wrong.append(f"{command.where}: {command.script.relative_to(ROOT)} does not exist")
            continue
        parser = parser_of(command.script)
        if isinstance(parser, str):
            wrong.append(f"{command.where}: {command.script.relative_to(ROOT)} {parser}")
            continue
        if parser is None:
            if any(word.startswith("-") and word != "--help" for word in command.argv):
                wrong.append(f"{command.where}: {command.script.relative_to(ROOT)} parses no flags, given {command.argv}")
            continue
        if (why := refusal(parser, command.argv)) is not None:
            wrong.append(f"{command.where}: {command.script.relative_to(ROOT)} {' '.join(command.argv)}: {why}")
    assert not wrong, "\n".join(wrong)


# ----------------------------------------------------------------------------- the README's figures


RESULTS = ROOT / "benchmarks" / "results"
# A measured figure: a decimal of three or more places (2.186), a percentage (18-19%, 15.5%), or
# minutes:seconds (5:52). Versions, thresholds and counts are not figures.
FIGURE = re.compile(r"(?<![\w.:/-])(\d+\.\d{3,}|\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?%|\d{1,2}:\d\d)(?![\w.:/-]?\d)")
# The README's own statements of a threshold or tolerance (what the code does, not a measurement).
NOT_MEASURED = re.compile(r"within \d+%|more than \d+%|or \d+% in one|\d+% slower|arXiv \d+\.\d+")


def result_numbers() -> set[str]:
    """Every number of every results file, and as the README rounds it (3 and 4 places, and
    percentages with 0-2 places where a value is a share)."""
    found: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            for places in (1, 2, 3, 4):
                found.add(f"{value:.{places}f}")
        elif isinstance(value, str):
            found.update(FIGURE.findall(value))
    for path in RESULTS.rglob("*.json"):
        walk(json.loads(path.read_text()))
    for path in RESULTS.rglob("*.txt"):
        found.update(FIGURE.findall(path.read_text()))
    for path in RESULTS.rglob("*.log"):
        found.update(FIGURE.findall(path.read_text()))
    return found


def sections_with_commands() -> list[str]:
    """The sections of docs/ and benchmarks/README.md (heading to heading) that name a command
    (``python ...``, ``torchrun ...``): where a figure may be quoted from."""
    found = []
    for path in (*sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"):
        for section in re.split(r"\n(?=#+ )", path.read_text()):
            if re.search(r"(?:python|torchrun) [\w/-]+\.py|python -m \w", section):
                found.append(section)
    return found


def test_readme_figures_come_from_results_or_documented_runs() -> None:
    """Every measured figure the top README quotes is in a results file (benchmarks/results/, as
    the README rounds it) or in a section of docs/ that names the command it came from."""
    numbers, sections = result_numbers(), sections_with_commands()
    unsourced, checked = [], 0
    for number, sentence in prose(ROOT / "README.md"):
        sentence = NOT_MEASURED.sub("", sentence)
        for figure in FIGURE.findall(sentence):
            checked += 1
            parts = re.findall(r"\d+(?:\.\d+)?", figure) if figure.endswith("%") else [figure]
            in_results = all(part in numbers or f"{float(part) / 100:.4f}".rstrip("0") in numbers for part in parts) \
                if figure.endswith("%") else figure in numbers
            if not in_results and not any(figure in section for section in sections):
                unsourced.append(f"README.md:{number}: {figure} in: {sentence[:140]}")
    assert checked > 10, f"only {checked} figures found: the pattern or the README changed"
    assert not unsourced, "figures with no results file or documented run behind them:\n" + "\n".join(unsourced)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="docs/api.md's defaults block, from the code")
    parser.add_argument("--write", action="store_true", help="rewrite the block (else print it)")
    if parser.parse_args().write:
        write()
    else:
        print(defaults_block())
