"""Training progress on the console: a tqdm bar on a terminal, periodic plain lines elsewhere.

A bar needs a terminal that reports its width: CI logs and some IDE consoles report 0 columns
(tqdm then draws an empty bar) or are not terminals at all (carriage-return redraws pile up as
one long line). There the same figures come out as one plain line every `every` steps.
"""
from __future__ import annotations

import os
import sys

MIN_BAR_COLUMNS = 40  # narrower than this, a bar with loss / tok/s / lr postfix is unreadable


def terminal_columns(stream) -> int:
    """The stream's terminal width, 0 when it is not a terminal or reports no usable width."""
    try:
        if not stream.isatty():
            return 0
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 0
    if columns <= 0:  # a pty that never got a size: $COLUMNS may still know
        try:
            columns = int(os.environ.get("COLUMNS", "0"))
        except ValueError:
            columns = 0
    return max(columns, 0)


class Progress:
    def __init__(self, total: int, initial: int, *, stream=None, log=print, every: int | None = None):
        self.total, self.log = total, log
        self.every = every or max(1, total // 25)
        stream = sys.stderr if stream is None else stream
        self.bar = None
        if terminal_columns(stream) >= MIN_BAR_COLUMNS:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, file=stream)

    def update(self, step: int, record: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=record["tok_per_s"], lr=f"{record['lr']:.2e}")
            self.bar.update(1)
        elif step % self.every == 0 or step == self.total:
            self.log(f"step {step}/{self.total}: loss {record['loss']:.4f}, {record['tok_per_s']:,} tok/s, "
                     f"lr {record['lr']:.2e}, {record['elapsed']:.0f} s", flush=True)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            self.log(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
