"""Markdown -> HTML for the chat view: markdown-it-py for the text, Pygments for code.

The HTML targets Qt's rich-text engine (QTextDocument), which understands a subset of
HTML 4 and inline CSS: code blocks become one-cell tables (the only block Qt paints a
background behind), Pygments writes inline colours instead of CSS classes, and every
code block carries a ``copy-code:N`` link that the message widget turns into "copy
this block". Raw HTML in model output is shown as text, never interpreted.

Streaming: :class:`StreamingMarkdown` renders a growing reply without redoing the
whole text each time. Everything up to the last blank line outside a code fence is
rendered once and kept; only the tail after it is rendered again on each flush, so a
long reply costs a short render per flush instead of a render of everything so far.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field

from markdown_it import MarkdownIt
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import TextLexer, get_lexer_by_name
from pygments.util import ClassNotFound

COPY_CODE_SCHEME = "copy-code"
# Control characters (a small or confused model emits them) would vanish or draw boxes;
# show them as the replacement character so the reader sees that something was there.
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


@dataclass(frozen=True)
class HtmlColors:
    """Colours the generated HTML uses, one set per theme."""

    text: str
    muted: str
    code_background: str
    code_header: str
    code_border: str
    inline_code_background: str
    link: str
    table_border: str
    pygments_style: str


LIGHT_COLORS = HtmlColors(
    text="#1f2328", muted="#59636e", code_background="#f6f8fa", code_header="#eaeef2",
    code_border="#d1d9e0", inline_code_background="#eff1f3", link="#0969da", table_border="#d1d9e0",
    pygments_style="default",
)
DARK_COLORS = HtmlColors(
    text="#e6edf3", muted="#9198a1", code_background="#161b22", code_header="#21262d",
    code_border="#3d444d", inline_code_background="#2d333b", link="#4493f8", table_border="#3d444d",
    pygments_style="github-dark",
)


@dataclass
class RenderedMarkdown:
    """HTML for one text, and the raw source of each code block (index = N of ``copy-code:N``)."""

    html: str
    code_blocks: list[str] = field(default_factory=list)


class MarkdownRenderer:
    """Renders Markdown (CommonMark + tables + strikethrough) to Qt-friendly HTML."""

    def __init__(self, colors: HtmlColors = LIGHT_COLORS) -> None:
        self.colors = colors
        try:
            self._formatter = HtmlFormatter(nowrap=True, noclasses=True, style=colors.pygments_style)
        except ClassNotFound:  # an older Pygments without that style
            self._formatter = HtmlFormatter(nowrap=True, noclasses=True)
        # html=False: tags in model output are escaped and shown, never executed or styled.
        md = MarkdownIt("commonmark", {"html": False, "breaks": False})
        md.enable(["table", "strikethrough"])
        # markdown-it binds a rule to its renderer (rule.__get__(renderer)), which would
        # replace `self` of a bound method; plain closures keep this object reachable.
        for name, rule in (("fence", self._fence), ("code_block", self._fence), ("code_inline", self._code_inline),
                           ("table_open", self._table_open), ("link_open", self._link_open)):
            md.add_render_rule(name,
                               lambda _renderer, tokens, idx, options, env, rule=rule: rule(tokens, idx, options, env))
        self._md = md

    def render(self, text: str, *, first_code_index: int = 0) -> RenderedMarkdown:
        """HTML for ``text``; code-block links are numbered from ``first_code_index``."""
        env: dict = {"code_blocks": [], "first": first_code_index}
        body = self._md.render(_CONTROL_CHARS.sub("\ufffd", text), env)
        return RenderedMarkdown(body, env["code_blocks"])

    # Render rules ---------------------------------------------------------------
    def _fence(self, tokens, idx, _options, env) -> str:
        token = tokens[idx]
        code = token.content
        language = (token.info or "").strip().split(maxsplit=1)[0] if token.info else ""
        index = env["first"] + len(env["code_blocks"])
        env["code_blocks"].append(code)
        c = self.colors
        try:
            lexer = get_lexer_by_name(language, stripnl=False) if language else TextLexer(stripnl=False)
        except ClassNotFound:
            lexer = TextLexer(stripnl=False)
        body = highlight(code, lexer, self._formatter).rstrip("\n")
        label = html.escape(language or "code")
        return (
            f'<table width="100%" cellspacing="0" cellpadding="6" border="1" '
            f'style="border-color:{c.code_border}; border-style:solid; margin-top:4px; margin-bottom:8px;">'
            f'<tr><td bgcolor="{c.code_header}">'
            f'<table width="100%" cellspacing="0" cellpadding="0"><tr>'
            f'<td><span style="color:{c.muted};">{label}</span></td>'
            f'<td align="right"><a href="{COPY_CODE_SCHEME}:{index}" style="color:{c.link}; text-decoration:none;">'
            f"Copy code</a></td></tr></table></td></tr>"
            f'<tr><td bgcolor="{c.code_background}"><pre style="margin:0;">{body}</pre></td></tr></table>\n'
        )

    def _code_inline(self, tokens, idx, _options, _env) -> str:
        return (f'<code style="background-color:{self.colors.inline_code_background};">'
                f"{html.escape(tokens[idx].content)}</code>")

    def _table_open(self, _tokens, _idx, _options, _env) -> str:
        return (f'<table border="1" cellspacing="0" cellpadding="4" '
                f'style="border-color:{self.colors.table_border}; border-style:solid; margin-bottom:8px;">\n')

    def _link_open(self, tokens, idx, options, env) -> str:
        tokens[idx].attrSet("style", f"color:{self.colors.link};")
        return self._md.renderer.renderToken(tokens, idx, options, env)


# A fence line opens or closes a fenced code block (CommonMark: up to 3 spaces, then ``` or ~~~).
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def stable_prefix_length(text: str, start: int = 0) -> int:
    """Length of the longest prefix of ``text`` whose Markdown cannot change when more text is appended.

    The prefix ends right after a blank line that lies outside any code fence and is
    followed by a line that starts a new top-level block (not indented, so it is not a
    list continuation or an indented code block). ``start`` must itself be such a point
    (0 is); the scan begins there. Returns ``start`` when no later point exists.
    """
    best = start
    fence: str | None = None
    pos = start
    previous_blank = False
    while True:
        end = text.find("\n", pos)
        if end < 0:
            return best  # the last line is still being written
        line = text[pos:end]
        match = _FENCE.match(line)
        if fence is None and previous_blank and line.strip() and not line[0].isspace():
            best = pos
        if match:
            marker = match.group(1)
            if fence is None:
                fence = marker
            elif marker[0] == fence[0] and len(marker) >= len(fence) and not line.strip().strip(marker[0]):
                fence = None
        previous_blank = fence is None and not line.strip()
        pos = end + 1


class StreamingMarkdown:
    """Renders one growing text, re-rendering only the part after its last stable point."""

    def __init__(self, renderer: MarkdownRenderer) -> None:
        self.renderer = renderer
        self._stable_text = ""
        self._stable_html: list[str] = []
        self._stable_blocks: list[str] = []

    def render(self, text: str) -> RenderedMarkdown:
        """HTML for ``text`` (which normally extends the previous call's text)."""
        if not text.startswith(self._stable_text):
            self.__init__(self.renderer)  # the text was replaced, not extended: start over
        cut = stable_prefix_length(text, len(self._stable_text))
        if cut > len(self._stable_text):
            chunk = self.renderer.render(text[len(self._stable_text):cut], first_code_index=len(self._stable_blocks))
            self._stable_html.append(chunk.html)
            self._stable_blocks.extend(chunk.code_blocks)
            self._stable_text = text[:cut]
        tail = self.renderer.render(text[cut:], first_code_index=len(self._stable_blocks))
        return RenderedMarkdown("".join(self._stable_html) + tail.html, self._stable_blocks + tail.code_blocks)
