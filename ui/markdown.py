"""Markdown -> Qt rich-text HTML for untrusted model output.

Model output is untrusted, so: raw HTML is escaped (markdown-it with html=False), images
become their alt text (nothing is ever fetched), and only http(s) links stay links; every
other scheme (javascript:, file:, data:, ...) renders as plain text. Links are opened by the
view only when clicked. Code blocks get a monospace box with a copy link.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from urllib.parse import urlparse

from markdown_it import MarkdownIt

ALLOWED_LINK_SCHEMES = ("http", "https")
COPY_SCHEME = "pw-copy"  # href of a code block's copy link: pw-copy:<message id>/<block index>


@dataclass(frozen=True)
class Theme:
    """Colours for the rendered HTML (rich text cannot read the palette itself)."""

    code_bg: str = "#f3f4f6"
    code_header_bg: str = "#e5e7eb"
    muted: str = "#6b7280"
    link: str = "#2563eb"


@dataclass
class Rendered:
    html: str
    code_blocks: list[str] = field(default_factory=list)


def is_safe_link(href: str) -> bool:
    """True only for http(s) URLs with a host: the only links a click may open."""
    try:
        parsed = urlparse(href.strip())
    except ValueError:
        return False
    return parsed.scheme.lower() in ALLOWED_LINK_SCHEMES and bool(parsed.netloc)


def _parser() -> MarkdownIt:
    # breaks: a single newline is a line break, as chat apps show it (a poem keeps its lines;
    # CommonMark would join them into one paragraph line).
    md = MarkdownIt("commonmark", {"html": False, "linkify": False, "typographer": False,
                                   "breaks": True})
    md.enable(["table", "strikethrough"])
    md.add_render_rule("link_open", _link_open)
    md.add_render_rule("link_close", _link_close)
    md.add_render_rule("image", _image)
    md.add_render_rule("fence", _fence)
    md.add_render_rule("code_block", _fence)
    md.add_render_rule("code_inline", _code_inline)
    return md


def _link_open(self, tokens, idx, options, env) -> str:
    href = tokens[idx].attrGet("href") or ""
    safe = is_safe_link(str(href))
    env.setdefault("links", []).append(safe)
    if not safe:
        return f'<span style="color:{env["theme"].muted}">'
    return f'<a href="{html.escape(str(href), quote=True)}">'


def _link_close(self, tokens, idx, options, env) -> str:
    safe = env["links"].pop() if env.get("links") else False
    return "</a>" if safe else "</span>"


def _image(self, tokens, idx, options, env) -> str:
    alt = self.renderInlineAsText(tokens[idx].children or [], options, env)
    return f'<span style="color:{env["theme"].muted}">[image: {html.escape(alt)}]</span>'


def _code_inline(self, tokens, idx, options, env) -> str:
    code = html.escape(tokens[idx].content)
    return f'<code style="background-color:{env["theme"].code_bg}">{code}</code>'


def _fence(self, tokens, idx, options, env) -> str:
    token = tokens[idx]
    code = token.content.rstrip("\n")
    blocks: list[str] = env["code_blocks"]
    index = len(blocks)
    blocks.append(code)
    theme: Theme = env["theme"]
    language = html.escape(token.info.split()[0]) if token.info.strip() else "code"
    copy_href = f"{COPY_SCHEME}:{env['message_id']}/{index}"
    return (
        f'<table width="100%" cellspacing="0" cellpadding="6" '
        f'style="margin-top:4px; margin-bottom:8px; background-color:{theme.code_bg}">'
        f'<tr><td style="background-color:{theme.code_header_bg}; color:{theme.muted}">'
        f'{language}</td><td align="right" style="background-color:{theme.code_header_bg}">'
        f'<a href="{copy_href}">Copy</a></td></tr>'
        f'<tr><td colspan="2"><pre style="font-family:monospace">{html.escape(code)}</pre>'
        f"</td></tr></table>"
    )


_MD = _parser()


def render_markdown(text: str, message_id: int = 0, theme: Theme | None = None) -> Rendered:
    """Render untrusted Markdown to inert rich-text HTML plus the raw text of its code blocks."""
    code_blocks: list[str] = []
    env = {"theme": theme or Theme(), "code_blocks": code_blocks, "message_id": message_id,
           "links": []}
    body = _MD.render(text, env)
    return Rendered(body, code_blocks)


def render_plain(text: str) -> str:
    """The plain-text view: the exact characters, escaped, wrapping preserved."""
    return f'<p style="white-space:pre-wrap">{html.escape(text)}</p>'
