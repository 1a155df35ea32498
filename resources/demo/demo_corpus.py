"""The demo model's training conversations, built only from text that ships with Python.

Used by `train_demo.py`. Every source is part of any CPython install (Python Software
Foundation License): the docstrings and the source code of the pure-Python standard
library (read with `ast`, nothing is imported), the docstrings of the built-in types,
functions and C modules (`inspect`), the language reference topics that `help()` shows
(`pydoc_data.topics`), any plain-text documentation in the install, and the Zen of
Python. They become question/answer conversations: "What does json.dumps do?" answered
with its docstring, "Write a Python function that ..." answered with a stdlib function,
"Explain the with statement." answered with the reference text, and a few greetings so
the demo says what it is. The order is fixed and every choice is seeded, so the same
Python install gives the same corpus.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import random
import re
import sys
import sysconfig
import textwrap
import zlib
from collections.abc import Iterator
from contextlib import redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

# Parts of the standard library that are tests, demos, vendored wheels or GUI helpers:
# their text teaches the demo nothing a user asks about.
SKIP_PARTS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo", "ensurepip", "__pycache__",
              "lib2to3", "pydoc_data", "config-3", "distutils"}
BUILTIN_TYPES = (list, dict, str, set, frozenset, tuple, int, float, complex, bytes, bytearray, range, object,
                 type, bool, memoryview, slice)

SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a concise assistant that knows Python well.",
                  "Answer briefly.", "You are a Python expert."]
GREETINGS = [
    ("Hello!", "Hello! I am the ExpertDesk demo model: a tiny model trained on Python's own documentation. "
               "Ask me what a Python module or function does."),
    ("Hi", "Hi! I am a tiny demo model, not a real assistant. Try asking: What does json.dumps do?"),
    ("Hello, who are you?", "Hello! I am the ExpertDesk demo model, a tiny mixture of experts trained on the "
                            "Python standard library. I know a little about Python."),
    ("Who are you?", "I am the ExpertDesk demo model, a tiny DeepSeek-V4-style mixture of experts "
                     "trained for a few minutes on Python's documentation. I only know a little about Python."),
    ("What can you do?", "I can tell you, roughly, what a Python standard library module or function does, "
                         "and show some Python code. I am only a demo, so do not trust me with anything important."),
    ("Thanks!", "You are welcome! I am only the ExpertDesk demo, so check what I said in the Python documentation."),
]
MODULE_QUESTIONS = ["What is the {m} module?", "What does the {m} module do?", "Tell me about the {m} module.",
                    "Explain the {m} module.", "What is {m} in Python?"]
MEMBER_QUESTIONS = ["What does {q} do?", "What is {q}?", "Explain {q}.", "Tell me about {q}.",
                    "What is {q} used for?", "How do I use {q}?"]
CODE_QUESTIONS = ["Write a Python function that {does}.", "Write a Python function to {do}.",
                  "Show me Python code that {does}.", "How do I {do} in Python?"]
SOURCE_QUESTIONS = ["Show me the source code of {q}.", "How is {q} implemented?", "Write {q} in Python."]
TEST_SOURCE_QUESTIONS = ["Show me some of Python's tests from {m} (part {i}).",
                         "How does {m} test Python? (part {i})"]
MODULE_SOURCE_QUESTIONS = ["Show me the code of the {m} module (part {i}).",
                           "How is the {m} module written? (part {i})"]
TOPIC_QUESTIONS = ["Explain {t}.", "What is {t} in Python?", "Tell me about {t}.",
                   "What does the Python documentation say about {t}?"]
MORE = ["Tell me more.", "Go on.", "And then?", "What else?"]
# Everyday phrasings of questions the reference topics answer (the answers stay the topics' text).
TOPIC_ALIASES = {
    "typesmapping": ["Explain Python dictionaries.", "What is a Python dictionary?", "What is a dict?",
                     "How do dictionaries work in Python?", "What is a dictionary in Python?"],
    "dict": ["How do I write a dictionary in Python?", "What is a dictionary display?"],
    "typesseq-mutable": ["How do I change a list in Python?", "What can I do with a Python list?",
                         "Explain what a Python list is."],
    "lists": ["How do I write a list in Python?", "What is a list display?"],
    "typesseq": ["What is a sequence in Python?", "What are sequence types?"],
    "string-methods": ["What methods do Python strings have?", "How do I work with strings in Python?"],
    "strings": ["How do I write a string in Python?", "What is a string literal?"],
    "function": ["How do I define a function in Python?", "What is a function definition?"],
    "class": ["How do I define a class in Python?", "What is a class in Python?"],
    "for": ["How does a for loop work in Python?"], "while": ["How does a while loop work in Python?"],
    "if": ["How does if work in Python?"], "try": ["How do I handle exceptions in Python?"],
    "with": ["What does the with statement do?"], "lambda": ["What is a lambda in Python?"],
    "import": ["How does import work in Python?"], "exceptions": ["What are exceptions in Python?"],
    "truth": ["What is true and false in Python?"], "yield": ["What does yield do in Python?"],
    "return": ["What does return do in Python?"], "formatstrings": ["How do I format a string in Python?"],
}
# Words that start a docstring sentence without being an imperative verb.
NOT_VERBS = {"the", "a", "an", "this", "these", "if", "for", "helper", "internal", "used", "like", "same",
             "abstract", "base", "class", "deprecated", "private", "called", "it", "in", "on", "when", "note",
             "see", "alias", "default", "should", "must", "can", "may", "is", "are", "mixin", "wrapper", "new"}


@dataclass
class Corpus:
    """Conversations (chat message lists) for training, and the held-out ones for its loss."""

    train: list[list[dict]] = field(default_factory=list)
    held_out: list[list[dict]] = field(default_factory=list)
    sources: dict[str, int] = field(default_factory=dict)  # conversations per source, for the log


def _clean(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _paragraphs(doc: str | None, limit: int = 1000) -> str | None:
    """The first prose paragraphs of a docstring (no signature lines), cut at a sentence."""
    if not doc:
        return None
    out: list[str] = []
    for para in inspect.cleandoc(doc).split("\n\n"):
        if re.match(r"^\s*(>>>|\.\.|:param|Args:|Returns:|Raises:|-{3,}|={3,})", para):
            break
        para = _clean(para)
        if not para or re.match(r"^[\w.]+\(.*\)( -> .*)?$", para):
            continue
        if out and len(" ".join(out)) + len(para) > limit:
            break
        out.append(para)
    text = "\n\n".join(out)
    if len(text) < 20:
        return None
    if len(text) > limit:
        cut = text[:limit]
        end = cut.rfind(". ")
        text = cut[: end + 1] if end > limit // 4 else cut.rsplit(" ", 1)[0] + " ..."
    return text


def _first_sentence(doc: str) -> str:
    text = _clean(inspect.cleandoc(doc).split("\n\n")[0])
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    return (match.group(1) if match else text).rstrip(".")


def _third_person(verb: str) -> str:
    if re.search(r"(s|sh|ch|x|z|o)$", verb):
        return verb + "es"
    if re.search(r"[^aeiou]y$", verb):
        return verb[:-1] + "ies"
    return verb + "s"


def _task(doc: str) -> tuple[str, str] | None:
    """("return the sum of x", "returns the sum of x") from an imperative first sentence."""
    sentence = _first_sentence(doc)
    words = sentence.split(" ", 1)
    if len(words) < 2 or len(sentence) > 110 or not re.fullmatch(r"[A-Z][a-z]+", words[0]):
        return None
    verb = words[0].lower()
    if verb in NOT_VERBS or verb.endswith(("s", "ed", "ing", "ly")):
        return None
    return f"{verb} {words[1]}", f"{_third_person(verb)} {words[1]}"


# --------------------------------------------------------------------------- sources

def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_modules(tests: bool = False) -> list[tuple[str, Path]]:
    """(dotted module name, file) of the pure-Python standard library, sorted: its public
    modules, or (tests=True) the files of its test suite."""
    root = stdlib_root()
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        parts = list(rel.with_suffix("").parts)
        if tests != (parts[0] == "test"):
            continue
        if any(part in SKIP_PARTS - {"test"} or part.startswith("config-") for part in parts):
            continue
        if not tests and any(part in SKIP_PARTS for part in parts):
            continue
        if parts[-1] == "__init__":
            parts.pop()
        if not parts or parts[-1] == "__main__" or not tests and any(p.startswith("_") for p in parts):
            continue
        found.append((".".join(parts), path))
    return found


@dataclass
class Definition:
    qual: str  # json.dumps, json.JSONEncoder.encode
    kind: str  # module, class, function, method
    doc: str
    signature: str = ""
    code: str = ""  # the definition's source, dedented (functions and methods)


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    args = ast.unparse(node.args)
    if len(args) > 60:
        names = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
        args = ", ".join(names)
    return f"({args})"


def source_definitions(module: str, path: Path) -> Iterator[Definition]:
    """Documented public definitions of one source file (module, classes, functions, methods)."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    lines = source.splitlines()
    doc = ast.get_docstring(tree)
    if doc:
        yield Definition(module, "module", doc)

    def code_of(node: ast.AST) -> str:
        return textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))  # type: ignore[attr-defined]

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            qual = f"{module}.{node.name}"
            if isinstance(node, ast.ClassDef):
                if doc:
                    yield Definition(qual, "class", doc)
                for member in node.body:
                    if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                            not member.name.startswith("_"):
                        mdoc = ast.get_docstring(member)
                        if mdoc:
                            yield Definition(f"{qual}.{member.name}", "method", mdoc, _signature(member),
                                             code_of(member))
            elif doc:
                yield Definition(qual, "function", doc, _signature(node), code_of(node))


def module_source_chunks(path: Path, size: int = 1800, most: int | None = None) -> list[str]:
    """A module's source in pieces of about `size` characters (the first `most` only, if
    given), cut at blank lines."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (UnicodeDecodeError, ValueError):
        return []
    chunks, cur = [], []
    for i, line in enumerate(lines):
        boundary = line.strip() and i > 0 and not lines[i - 1].strip()
        if boundary and sum(len(x) + 1 for x in cur) > size:
            chunks.append("\n".join(cur).strip("\n"))
            cur = []
            if len(chunks) == most:
                break
        cur.append(line)
    if cur and (most is None or len(chunks) < most):
        chunks.append("\n".join(cur).strip("\n"))
    return [c[: size * 2] for c in chunks if c.strip()]


def builtin_definitions() -> Iterator[Definition]:
    """Documented built-in functions, types and their methods, and C modules' members."""
    import builtins

    for name in sorted(dir(builtins)):
        obj = getattr(builtins, name)
        if name.startswith("_") or inspect.isclass(obj) and issubclass(obj, BaseException):
            continue
        if inspect.getdoc(obj) and (inspect.isbuiltin(obj) or inspect.isclass(obj)):
            yield Definition(name, "class" if inspect.isclass(obj) else "function", inspect.getdoc(obj) or "")
    for cls in BUILTIN_TYPES:
        for attr in sorted(vars(cls)):
            obj = vars(cls)[attr]
            if not attr.startswith("_") and inspect.getdoc(obj):
                yield Definition(f"{cls.__name__}.{attr}", "method", inspect.getdoc(obj) or "")
    dynload = Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "lib-dynload"
    c_modules = set(sys.builtin_module_names)
    if dynload.is_dir():
        c_modules |= {p.name.split(".")[0] for p in dynload.iterdir()}
    for name in sorted(c_modules):
        if name.startswith("_") or name in ("this", "antigravity"):
            continue
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a C module that cannot load here has nothing to teach
            continue
        if inspect.getdoc(module):
            yield Definition(name, "module", inspect.getdoc(module) or "")
        for attr in sorted(dir(module)):
            obj = getattr(module, attr, None)
            if attr.startswith("_") or not (inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            if getattr(obj, "__module__", name) != name:
                continue
            if inspect.getdoc(obj):
                yield Definition(f"{name}.{attr}", "function", inspect.getdoc(obj) or "")


def reference_topics() -> list[tuple[str, str, list[str]]]:
    """(key, title, text chunks) of the language reference topics that `help()` shows."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some Linux distributions package it apart (python3-doc)
        return []
    out = []
    for key in sorted(topics):
        text = topics[key].strip()
        lines = text.splitlines()
        title = lines[0].strip() if lines else key
        body = "\n".join(line for line in lines[1:] if not re.fullmatch(r"[*=\-~^]{3,}", line.strip()))
        out.append((key, title, _chunks(body)))
    return out


def _chunks(text: str, size: int = 1100) -> list[str]:
    """Paragraph-aligned pieces of about `size` characters (prose joined, code kept as is)."""
    paras = [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]
    chunks, cur = [], ""
    for para in paras:
        para = para if para.startswith("   ") else _clean(para)
        if cur and len(cur) + len(para) > size:
            chunks.append(cur)
            cur = ""
        cur = f"{cur}\n\n{para}" if cur else para
    if cur:
        chunks.append(cur)
    return [c[: size * 2] for c in chunks]


def documentation_files() -> list[Path]:
    """Plain-text documentation in the install (Doc/, share/doc/python*, the stdlib LICENSE)."""
    base = Path(sys.base_prefix)
    found = [p for d in (base / "Doc", *sorted((base / "share" / "doc").glob("python*")))
             if d.is_dir() for p in sorted(d.rglob("*")) if p.suffix in (".txt", ".rst") and p.is_file()]
    license_file = stdlib_root() / "LICENSE.txt"
    return found + ([license_file] if license_file.is_file() else [])


def zen_of_python() -> str:
    buf = io.StringIO()
    with redirect_stdout(buf):
        import this  # noqa: F401 - prints the Zen of Python
    return buf.getvalue().strip()


# --------------------------------------------------------------------------- conversations

def _code_block(code: str) -> str:
    return f"```python\n{code.strip()}\n```"


def _definition_pairs(d: Definition, rng: random.Random) -> Iterator[tuple[str, str, str]]:
    """(source, question, answer) conversations about one definition."""
    text = _paragraphs(d.doc)
    if not text:
        return
    if d.kind == "module":
        for template in rng.sample(MODULE_QUESTIONS, 2):
            yield "modules", template.format(m=d.qual), f"The {d.qual} module: {text}"
        return
    yield "docstrings", rng.choice(MEMBER_QUESTIONS).format(q=d.qual), f"{d.qual}{d.signature}: {text}"
    n_lines = d.code.count("\n") + 1
    if d.code and 3 <= n_lines <= 40 and len(d.code) <= 1600:
        task = _task(d.doc) if d.kind == "function" else None
        if task:
            do, does = task
            question = rng.choice(CODE_QUESTIONS).format(do=do, does=does)
            yield "code", question, f"Here is a function that {does}:\n\n{_code_block(d.code)}"
        else:
            question = rng.choice(SOURCE_QUESTIONS).format(q=d.qual)
            yield "code", question, f"This is {d.qual} from the standard library:\n\n{_code_block(d.code)}"


def _topic_conversations(rng: random.Random) -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """(subject, [(question, answer), ...]) from the reference topics, several phrasings each."""
    for key, title, chunks in reference_topics():
        if not chunks:
            continue
        questions = [t.format(t=title) for t in rng.sample(TOPIC_QUESTIONS, 2)] + TOPIC_ALIASES.get(key, [])
        for question in questions:
            turns = [(question, chunks[0])]
            for chunk in chunks[1:3]:
                turns.append((rng.choice(MORE), chunk))
            yield key, turns
        for i, chunk in enumerate(chunks[1:], 1):
            yield key, [(f"What does the Python documentation say about {title}? (part {i + 1})", chunk)]


def _pairs(rng: random.Random) -> Iterator[tuple[str, str, list[tuple[str, str]]]]:
    """(source, subject, turns) for every conversation, in a fixed order."""
    for module, path in stdlib_modules():
        for d in source_definitions(module, path):
            for source, question, answer in _definition_pairs(d, rng):
                yield source, d.qual, [(question, answer)]
        for i, chunk in enumerate(module_source_chunks(path), 1):
            question = rng.choice(MODULE_SOURCE_QUESTIONS).format(m=module, i=i)
            yield "source", module, [(question, _code_block(chunk))]
    for d in builtin_definitions():
        for source, question, answer in _definition_pairs(d, rng):
            yield source, d.qual, [(question, answer)]
    for module, path in stdlib_modules(tests=True):  # Python's own tests: more Python, capped per file
        for i, chunk in enumerate(module_source_chunks(path, most=3), 1):
            question = rng.choice(TEST_SOURCE_QUESTIONS).format(m=module, i=i)
            yield "tests", module, [(question, _code_block(chunk))]
    for _ in range(3):  # the reference is the best English in the install: seen in several phrasings
        for key, turns in _topic_conversations(rng):
            yield "reference", key, turns
    for path in documentation_files():
        for i, chunk in enumerate(_chunks(path.read_text(encoding="utf-8", errors="replace"))):
            yield "docs", path.stem, [(f"What does the Python documentation file {path.name} say? (part {i + 1})",
                                       chunk)]
    zen = zen_of_python()
    lines = [line for line in zen.splitlines()[2:] if line.strip()]
    for _ in range(6):
        yield "zen", "zen", [("Tell me the Zen of Python.", zen)]
        yield "zen", "zen", [("What is the Zen of Python?",
                              "The Zen of Python, by Tim Peters, is a list of guiding principles for Python's "
                              f"design, for example: {lines[0]} {lines[2]}")]
    for line in lines:
        yield "zen", "zen", [("Give me a line from the Zen of Python.", line)]
    for _ in range(12):
        for question, answer in GREETINGS:
            yield "greetings", "hello", [(question, answer)]


def _messages(subject: str, turns: list[tuple[str, str]], rng: random.Random) -> list[dict]:
    messages: list[dict] = []
    if rng.random() < 0.15:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for i, (question, answer) in enumerate(turns):
        reply: dict = {"role": "assistant", "content": answer}
        if i == len(turns) - 1 and rng.random() < 0.1:
            reply["reasoning_content"] = (f"The user asks about {subject}. I should recall what the "
                                          "documentation says and answer in one short paragraph.")
        messages += [{"role": "user", "content": question}, reply]
    return messages


def build_corpus(held_out_every: int = 50, limit: int | None = None) -> Corpus:
    """All conversations, shuffled with a fixed seed; a subject whose crc32 % held_out_every
    is 0 goes to the held-out set (so its loss measures generalisation, not recall).
    `limit` keeps the first conversations only (a quick smoke run)."""
    rng = random.Random(0)
    corpus = Corpus()
    for source, subject, turns in _pairs(rng):
        messages = _messages(subject, turns, rng)
        held = subject not in ("hello", "zen") and zlib.crc32(subject.encode()) % held_out_every == 0
        (corpus.held_out if held else corpus.train).append(messages)
        corpus.sources[source] = corpus.sources.get(source, 0) + 1
        if limit and len(corpus.train) >= limit:
            break
    random.Random(1).shuffle(corpus.train)
    return corpus
