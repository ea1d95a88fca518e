"""A picture of a vision-language evaluation: the first held-out prompts' images, each with the answer
the policy gave and whether it scored, saved as ``RUN_DIR/eval/step-N.png`` beside the evaluation's
``step-N.jsonl``. ``noria report`` puts the first and the last evaluation's pictures side by side
(``noria.runview.report.sample_grids``), so what changed is seen on the images themselves.

What this module owns: ``save_answer_grid``. A cell is a prompt's first image, scaled to
``CELL_WIDTH`` pixels wide, over its answer (wrapped; green when it scored, red when not). Drawn
with Pillow's built-in font; nothing is drawn for a text run.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

GRID_PROMPTS = 12
"""Prompts drawn (the first of the split, one answer each)."""
COLUMNS = 4
CELL_WIDTH = 256
TEXT_LINES = 3
LINE_HEIGHT = 14


def save_answer_grid(samples: Sequence[Any], path: Path) -> Path | None:
    """Draw the first :data:`GRID_PROMPTS` samples with images (one per prompt) into ``path``; None
    (nothing written) when no sample has an image."""
    from PIL import Image, ImageDraw, ImageFont

    from noria.data.images import default_store

    seen, picked = set(), []
    for s in samples:
        if getattr(s, "images", None) and s.group_id not in seen and len(picked) < GRID_PROMPTS:
            seen.add(s.group_id)
            picked.append(s)
    if not picked:
        return None
    pictures = [default_store().get(s.images[0]).convert("RGB") for s in picked]
    image_height = max(round(CELL_WIDTH * p.height / p.width) for p in pictures)
    cell_height = image_height + TEXT_LINES * LINE_HEIGHT + 8
    rows = -(-len(picked) // COLUMNS)
    canvas = Image.new("RGB", (COLUMNS * (CELL_WIDTH + 8), rows * cell_height), "white")
    draw, font = ImageDraw.Draw(canvas), ImageFont.load_default()
    for i, (sample, picture) in enumerate(zip(picked, pictures)):
        x, y = (i % COLUMNS) * (CELL_WIDTH + 8), (i // COLUMNS) * cell_height
        canvas.paste(picture.resize((CELL_WIDTH, round(CELL_WIDTH * picture.height / picture.width)), Image.NEAREST), (x, y))
        colour = (0, 128, 0) if (sample.reward or 0) > 0 else (190, 0, 0)
        lines = textwrap.wrap(" ".join((sample.response_text or "").split()), 40)[:TEXT_LINES] or ["(no answer)"]
        for k, line in enumerate(lines):
            draw.text((x + 2, y + image_height + 4 + k * LINE_HEIGHT), line, fill=colour, font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)
    return path
