"""Draw docs/figures/reblock.png: the re-blocking rule of docs/layouts.md ("Re-blocking"), ten
tokens from P's blocks of 4 (NHD) to D's blocks of 8 (HND), one arrow per token, computed from
the rule itself (token t: P block src_ids[t // 4] slot t % 4 -> D block dst_ids[t // 8] slot
t % 8). ``python docs/figures/reblock.py`` from the repo root."""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

SRC_IDS, DST_IDS = [7, 2, 5], [3, 1]
BS_SRC, BS_DST, NUM_TOKENS = 4, 8, 10
OUT = pathlib.Path(__file__).resolve().with_suffix(".png")


def slot_x(block_index: int, slot: int, bs: int, gap: float = 0.6) -> float:
    """x of a slot's centre: blocks side by side, ``gap`` between them."""
    return block_index * (bs + gap) + slot + 0.5


def draw_row(ax, y: float, ids: list[int], bs: int, label: str, used: int) -> None:
    for i, block in enumerate(ids):
        for s in range(bs):
            t = i * bs + s
            filled = t < used
            ax.add_patch(Rectangle((slot_x(i, s, bs) - 0.5, y), 1, 0.8,
                                   facecolor="#9ecae1" if filled else "#f0f0f0",
                                   edgecolor="#555555"))
            ax.text(slot_x(i, s, bs), y + 0.4, str(t) if filled else "", ha="center",
                    va="center", fontsize=8)
        ax.text(slot_x(i, 0, bs) - 0.5, y + (1.0 if y > 1 else -0.35),
                f"block {block}", fontsize=8, va="center")
    ax.text(-0.6, y + 0.4, label, ha="right", va="center", fontsize=9)


def main() -> None:
    fig, ax = plt.subplots(figsize=(9, 2.6))
    y_src, y_dst = 2.4, 0.0
    draw_row(ax, y_src, SRC_IDS, BS_SRC, "P: block_size 4, NHD", NUM_TOKENS)
    draw_row(ax, y_dst, DST_IDS, BS_DST, "D: block_size 8, HND", NUM_TOKENS)
    for t in range(NUM_TOKENS):
        x0 = slot_x(t // BS_SRC, t % BS_SRC, BS_SRC)
        x1 = slot_x(t // BS_DST, t % BS_DST, BS_DST)
        ax.add_patch(FancyArrowPatch((x0, y_src), (x1, y_dst + 0.8), arrowstyle="-|>",
                                     mutation_scale=8, color="#3182bd", lw=0.8))
    ax.text(slot_x(1, 5, BS_DST), y_dst - 0.35, "slots past num_tokens: untouched",
            fontsize=8, ha="center")
    ax.set_xlim(-5.5, 18)
    ax.set_ylim(-0.7, 3.8)
    ax.axis("off")
    ax.set_title("token t: P (src_ids[t // 4], t % 4) -> D (dst_ids[t // 8], t % 8); "
                 "src_ids = [7, 2, 5], dst_ids = [3, 1], num_tokens = 10", fontsize=9)
    fig.tight_layout()
    fig.savefig(OUT, dpi=120)
    print(OUT)


if __name__ == "__main__":
    main()
