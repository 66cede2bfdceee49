"""Pathfinder (Linsley et al. 2018; LRA's Pathfinder-32): is there a path between the markers?

Each `size` x `size` grey image holds `2 + num_distractors` curved dashed contours, each made
of `contour_length` short straight dashes whose heading turns by a random angle from one dash
to the next (14 dashes: the hard variant), all at one grey level, and two 3 x 3 markers. A
positive image has both markers on the two ends of one contour; a negative has them on the
ends of two different contours, so the two classes hold the same number of contours, dashes
and markers.

Connectivity. Dashes are separated by a gap shorter than 2 pixels along the path, so within a
contour every drawn pixel lies within Chebyshev distance 2 of the next one; different contours
are kept at least Chebyshev distance 3 apart. "Connected" therefore means: reachable through
foreground pixels in steps of Chebyshev distance at most 2 (a flood fill on the image with a
5 x 5 neighbourhood), which bridges the dash gaps but never jumps between contours. `connected`
implements that test; the generator guarantees it matches the label.

Generation is vectorised over a chunk of images: every contour is a numpy random walk drawn for
the whole chunk at once, and a candidate that leaves the image or comes too close to the
contours already placed is redrawn only for the images it failed in.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from .common import LRASplit, LRATask, check_range, generated_task

logger = logging.getLogger(__name__)

SIZE = 32
HARD_LENGTH = 14  # dashes per contour in the hard variant (baseline: 6, intermediate: 9)
SIZES = {"train": 160_000, "val": 20_000, "test": 20_000}  # LRA's
DASH = 1.0  # pixels drawn per dash
GAP = 1.5  # pixels skipped between dashes: < 2, so a 5 x 5 neighbourhood bridges it
TURN = np.pi / 4  # largest change of heading from one dash to the next
STEP = 0.25  # sampling step along the path, in pixels
CONTOUR = 160  # the grey level of every contour: one level, so no contour can be told from
# another by its shade (a shade per contour let a model compare the pixels beside the two
# markers instead of following the path)
MARKER = 255
SEPARATION = 2  # dilation radius: other contours stay at Chebyshev distance > 2
MARKERS_APART = 2 * SEPARATION  # centres of two contours' markers: > 4 apart
TRIES = 100  # redraws of one contour before its image starts over
CHUNK = 4096
# Share of images whose contours fit apart (`_chunk`, 1024 images, seed 0): 0.60 at LRA's
# settings (14 dashes, 1 distractor, size 32), 1.0 with 9 dashes, 0.031 with 20, 0.039 with 2
# distractors, 0 at size 16. Below MIN_YIELD generation is refused, below SLOW_YIELD it warns.
# MIN_YIELD is judged over at least MIN_DRAWN candidates, drawn MIN_DRAW or more at a time.
LRA_YIELD, SLOW_YIELD, MIN_YIELD = 0.6, 0.1, 0.001
MIN_DRAW, MIN_DRAWN = 512, 2048
VERSION = 3  # part of the cache key: raise it whenever the same seed draws other images


def _dilate(masks: np.ndarray, radius: int) -> np.ndarray:
    """Binary dilation of (B, H, W) masks by a (2r+1)^2 square."""
    height, width = masks.shape[1:]
    padded = np.pad(masks, ((0, 0), (radius, radius), (radius, radius)))
    out = np.zeros_like(masks)
    for dy in range(2 * radius + 1):
        for dx in range(2 * radius + 1):
            out |= padded[:, dy : dy + height, dx : dx + width]
    return out


def connected(
    image: np.ndarray, start: tuple[int, int], end: tuple[int, int], reach: int = 2
) -> bool:
    """Whether `end` is reachable from `start` through foreground pixels (> 0) in steps of
    Chebyshev distance at most `reach` (2: the module's definition, which bridges dash gaps;
    1: a plain 8-connected flood fill, which stops at them).

    Args:
        image: (H, W) grey image.
        start, end: (row, column) pixels.
        reach: the longest step.
    """
    foreground = image > 0
    reached = np.zeros_like(foreground)
    reached[start] = foreground[start]
    while True:  # grow the reached set until it stops changing
        grown = _dilate(reached[None], reach)[0] & foreground
        if grown[end] or (grown == reached).all():
            return bool(grown[end])
        reached = grown


def _walk(
    rng: np.random.Generator, count: int, contour_length: int, size: int
) -> tuple[np.ndarray, np.ndarray]:
    """`count` dashed random walks: pixel (row, col) of every drawn sample (count, P, 2) and
    whether each walk stays inside the image with room for a 3 x 3 marker at both ends.

    The heading turns by up to TURN per dash; a dash that would leave the image turns instead
    toward the centre by up to twice that, so most walks fit without being drawn again."""
    low, high = 1.5, size - 2.5
    centre = (size - 1) / 2
    along = np.arange(int(round((DASH + GAP) / STEP))) * STEP
    along = along[along <= DASH]  # (S,) the drawn part of a dash
    position = rng.uniform(low, high, (count, 2))
    heading = rng.uniform(0, 2 * np.pi, count)
    samples = []
    for dash in range(contour_length):
        if dash:
            heading = heading + rng.uniform(-TURN, TURN, count)
        ahead = position + (DASH + GAP) * np.stack([np.sin(heading), np.cos(heading)], -1)
        leaving = ((ahead < low) | (ahead > high)).any(axis=1)
        toward = np.arctan2(centre - position[:, 0], centre - position[:, 1])
        turn = np.clip(np.angle(np.exp(1j * (toward - heading))), -2 * TURN, 2 * TURN)
        heading = np.where(leaving, heading + turn, heading)
        direction = np.stack([np.sin(heading), np.cos(heading)], -1)  # (count, 2)
        samples.append(position[:, None] + along[None, :, None] * direction[:, None])
        position = position + (DASH + GAP) * direction
    pixels = np.rint(np.concatenate(samples, axis=1)).astype(np.int64)  # (count, L * S, 2)
    inside = ((pixels >= 1) & (pixels <= size - 2)).all(axis=(1, 2))
    return pixels, inside


def _paint(pixels: np.ndarray, size: int) -> np.ndarray:
    """(B, size, size) masks of the pixels (B, P, 2) (clipped: callers drop walks outside)."""
    masks = np.zeros((len(pixels), size, size), dtype=bool)
    clipped = np.clip(pixels, 0, size - 1)
    masks[np.arange(len(pixels))[:, None], clipped[..., 0], clipped[..., 1]] = True
    return masks


def _square(masks: np.ndarray, centres: np.ndarray, where: np.ndarray) -> None:
    """Sets a 3 x 3 square around `centres` (B, 2) in the masks of the rows `where` (B,)."""
    rows = np.flatnonzero(where)
    centres = np.clip(centres, 1, masks.shape[1] - 2)  # walks outside are dropped anyway
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            masks[rows, centres[rows, 0] + dy, centres[rows, 1] + dx] = True


def _chunk(
    rng: np.random.Generator, labels: np.ndarray, contour_length: int, contours: int, size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Images for `labels` (uint8, (B, size, size)) and which of them were completed."""
    count = len(labels)
    occupied = np.zeros((count, size, size), dtype=bool)
    images = np.zeros((count, size, size), dtype=np.uint8)
    markers = np.zeros_like(occupied)
    done = np.ones(count, dtype=bool)
    for contour in range(contours):
        pending = done.copy()
        for _ in range(TRIES):
            rows = np.flatnonzero(pending)
            if not len(rows):
                break
            pixels, inside = _walk(rng, len(rows), contour_length, size)
            mask = _paint(pixels, size)
            marked = np.zeros_like(mask)
            # Contour 0 carries the first marker (and, in positives, the second); contour 1
            # carries the second marker in negatives; distractors carry none.
            _square(marked, pixels[:, 0], np.full(len(rows), contour == 0))
            end = (contour == 0) & (labels[rows] == 1) | (contour == 1) & (labels[rows] == 0)
            _square(marked, pixels[:, -1], end)
            clear = ~(_dilate(mask | marked, SEPARATION) & occupied[rows]).any(axis=(1, 2))
            # A positive's markers as far apart as a negative's can be (its contour ending
            # beside its start merged them into one blob: a label cue, ~2 % of positives).
            ends = np.abs(pixels[:, 0] - pixels[:, -1]).max(axis=1)  # Chebyshev distance
            apart = (ends > MARKERS_APART) | ~((contour == 0) & (labels[rows] == 1))
            good = inside & clear & apart
            ok = rows[good]
            images[ok] = np.where(mask[good], CONTOUR, images[ok])
            occupied[ok] |= mask[good] | marked[good]
            markers[ok] |= marked[good]
            pending[ok] = False
        done &= ~pending
    images[markers] = MARKER
    return images, done


def _draw(
    rng: np.random.Generator, want: np.ndarray, contour_length: int, distractors: int, size: int
) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    """Images for the labels `want` and which of them were made, from at least MIN_DRAW
    candidates (the labels cycled), so a few images left to redraw still get a whole batch of
    tries; and (candidates drawn, candidates that fit)."""
    draw = np.resize(want, max(len(want), MIN_DRAW))  # starts with `want` itself
    made, done = _chunk(rng, draw, contour_length, 2 + distractors, size)
    images, filled = made[: len(want)], done[: len(want)].copy()
    spare = np.flatnonzero(done[len(want) :]) + len(want)  # extra candidates that fit
    for value in (0, 1):
        need = np.flatnonzero(~filled & (want == value))
        have = spare[draw[spare] == value][: len(need)]
        images[need[: len(have)]] = made[have]
        filled[need[: len(have)]] = True
    return images, filled, (len(draw), int(done.sum()))


def generate_pathfinder(
    num: int,
    *,
    contour_length: int = HARD_LENGTH,
    num_distractors: int = 1,
    size: int = SIZE,
    seed: int | str = 0,
) -> LRASplit:
    """`num` Pathfinder images, half positive, flattened to `size * size` pixel tokens.

    Args:
        num: images.
        contour_length: dashes per contour, in [2, 20] (LRA's hard variant: 14).
        num_distractors: contours without markers besides the two marked ones, in [0, 3].
        size: image side in pixels, in [16, 128].
        seed: the random seed (the same seed gives the same images).

    Returns:
        The images as a split: uint8 grey levels (0 background), labels 1 = connected.

    Raises:
        ValueError: for a knob out of its range, or knobs with which almost no image can be
            drawn (fewer than 1 in 1000: e.g. size 16 with 14 dashes).
    """
    check_range("num", num, 1)
    check_range("contour_length", contour_length, 2, 20)
    check_range("num_distractors", num_distractors, 0, 3)
    check_range("size", size, 16, 128)
    rng = np.random.default_rng(list(f"pathfinder/{seed}".encode()))
    labels = rng.permutation(np.arange(num) % 2).astype(np.int8)
    images = np.zeros((num, size, size), dtype=np.uint8)
    todo, drawn, fitted = np.arange(num), 0, 0
    knobs = f"contour_length={contour_length}, num_distractors={num_distractors}, size={size}"
    with tqdm(total=num, desc="pathfinder", unit=" img", leave=False) as bar:
        while len(todo):
            rows = todo[:CHUNK]
            made, filled, counts = _draw(rng, labels[rows], contour_length, num_distractors, size)
            images[rows[filled]] = made[filled]
            todo = np.concatenate([todo[CHUNK:], rows[~filled]])
            bar.update(int(filled.sum()))
            # Images whose contours do not fit apart are drawn again: without end where almost
            # none fit (3 distractors at size 32, or size 16 at the hard length).
            first = drawn == 0
            drawn, fitted = drawn + counts[0], fitted + counts[1]
            if drawn >= MIN_DRAWN and fitted < drawn * MIN_YIELD:
                raise ValueError(
                    f"pathfinder: {fitted} of {drawn} images could be drawn with {knobs}: "
                    f"the contours do not fit apart; use fewer distractors, shorter contours or "
                    f"a larger size"
                )
            if first and fitted < drawn * SLOW_YIELD:
                logger.warning(
                    "pathfinder: only %.1f%% of images can be drawn with %s (%.0f%% at LRA's "
                    "settings): generation takes about %.0f times longer",
                    100 * fitted / drawn,
                    knobs,
                    100 * LRA_YIELD,
                    LRA_YIELD * drawn / max(fitted, 1),
                )
    lengths = np.full(num, size * size, dtype=np.int32)
    return LRASplit(images.reshape(num, -1), lengths, labels, f"pathfinder(seed={seed})")


def load_pathfinder(
    *,
    num_train: int = SIZES["train"],
    num_val: int = SIZES["val"],
    num_test: int = SIZES["test"],
    contour_length: int = HARD_LENGTH,
    num_distractors: int = 1,
    size: int = SIZE,
    seed: int = 0,
    cache_dir: str | Path | None = None,
) -> LRATask:
    """The Pathfinder task (LRA's sizes by default), generated once and cached.

    Args:
        num_train, num_val, num_test: images per split.
        contour_length, num_distractors, size: as `generate_pathfinder`.
        seed: the data seed; each split draws from its own stream.
        cache_dir: the cache root (None: the project's default).

    Returns:
        The task: 256 grey levels as tokens, 2 labels, no padding.

    Raises:
        ValueError: for a knob out of its range.
    """
    sizes = {"train": num_train, "val": num_val, "test": num_test}
    shape = {"contour_length": contour_length, "num_distractors": num_distractors, "size": size}
    return generated_task(
        "pathfinder",
        generate_pathfinder,
        sizes,
        shape,
        seed=seed,
        version=VERSION,
        cache_dir=cache_dir,
        row_bytes=size * size,
        vocab_size=256,
        num_labels=2,
        pad_id=0,  # every row is full length: no token is padding; 0 (background) is nominal
    )
