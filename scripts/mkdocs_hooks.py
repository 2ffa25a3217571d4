"""The documentation site's Markdown (`hooks` in `mkdocs.yml`).

An HTML comment inside a paragraph or a table cell is kept whole before links are
looked for, as CommonMark does (raw HTML binds more tightly than links). Python
Markdown reads such a comment last, after its links and mkdocs-autorefs' cross
references: the figure comments of the benchmarks pages' tables,
`<!-- figures: speed.json["results"]["rows"][1]["step ratio"] -->`, read as
references (`["rows"][1]`) that autorefs cannot find, a warning each. The page
comes out the same either way: an unresolved reference is put back as written.
"""

import markdown
from markdown.inlinepatterns import HtmlInlineProcessor


# Python Markdown's own pattern for a comment (`markdown.inlinepatterns.HTML_RE`).
_COMMENT = r"(<!--(?:(?!<!--|-->).)*-->)"


class _CommentsBeforeLinks(markdown.Extension):
    def extendMarkdown(self, md: markdown.Markdown) -> None:
        # After code spans (190) and backslash escapes (180), before reference links
        # (170), autorefs' (168) and the other links (160); Python Markdown's own
        # raw HTML pattern comes at 90.
        comments = HtmlInlineProcessor(_COMMENT, md)
        md.inlinePatterns.register(comments, "html_comment_before_links", 175)


def on_config(config):
    config.markdown_extensions.append(_CommentsBeforeLinks())
    return config
