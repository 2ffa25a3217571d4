"""The error catalogue, `docs/errors.md`: the short link a catalogued message ends
with."""


def see(number: int) -> str:
    """The last sentence of a catalogued error's message: its entry's short link.

    `raise ValueError(f"... the fix." + see(118))` ends the message with
    " See docs/errors.md#e118."
    """
    return f" See docs/errors.md#e{number}."
