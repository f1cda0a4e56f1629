"""A 3x5 pixel font for the PNG export (digits, letters drawn as capitals, a few signs).

Each glyph is five rows of three pixels, top to bottom, "1" = ink. Scaled by an integer
factor when drawn; one blank column between glyphs.
"""

from __future__ import annotations

from collections.abc import Callable

GLYPH_W, GLYPH_H = 3, 5
_GLYPHS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111",
    "3": "111001111001111", "4": "101101111001001", "5": "111100111001111",
    "6": "111100111101111", "7": "111001010010010", "8": "111101111101111",
    "9": "111101111001111", ".": "000000000000010", "-": "000000111000000",
    "+": "000010111010000", "(": "001010010010001", ")": "100010010010100",
    ":": "000010000010000", "/": "001001010100100", "|": "010010010010010",
    ",": "000000000010100", "_": "000000000000111", "=": "000111000111000",
    " ": "000000000000000", "?": "111001010000010", "#": "101111101111101",
    "A": "010101111101101", "B": "110101110101110", "C": "011100100100011",
    "D": "110101101101110", "E": "111100110100111", "F": "111100110100100",
    "G": "011100101101011", "H": "101101111101101", "I": "111010010010111",
    "J": "001001001101010", "K": "101101110101101", "L": "100100100100111",
    "M": "101111111101101", "N": "110101101101101", "O": "010101101101010",
    "P": "110101110100100", "Q": "010101101110011", "R": "110101110101101",
    "S": "011100010001110", "T": "111010010010010", "U": "101101101101111",
    "V": "101101101101010", "W": "101101111111101", "X": "101101010101101",
    "Y": "101101010010010", "Z": "111001010100111",
}  # fmt: skip


def glyph(char: str) -> str:
    """The 15 pixels of a character (lower case drawn as upper case; unknown ones as ?)."""
    return _GLYPHS.get(char.upper(), _GLYPHS["?"])


def text_width(text: str, scale: int) -> int:
    return max(0, len(text) * (GLYPH_W + 1) * scale - scale)


def draw_text(dot: Callable[[int, int], None], x: int, y: int, text: str, scale: int = 2) -> None:
    """Call `dot(x, y)` for every ink pixel of `text`, its top-left corner at (x, y)."""
    for index, char in enumerate(text):
        left = x + index * (GLYPH_W + 1) * scale
        bits = glyph(char)
        for row in range(GLYPH_H):
            for col in range(GLYPH_W):
                if bits[row * GLYPH_W + col] == "1":
                    for dy in range(scale):
                        for dx in range(scale):
                            dot(left + col * scale + dx, y + row * scale + dy)
