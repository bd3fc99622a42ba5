"""What the universal-checkpoint repros share: ``ds_to_universal`` run as users run it, in the rank's process."""

from __future__ import annotations

import sys
from pathlib import Path


def to_universal(checkpoint: Path, universal: Path) -> None:
    """Convert the saved ``checkpoint`` (a tag's folder) into ``universal`` with DeepSpeed's own command, in-process
    and with one worker each, so that a repro's fix (a patch of this process) applies. The command is one users run
    once; every rank runs it here into its own folder, so that every rank meets its error."""
    from deepspeed.checkpoint import ds_to_universal

    argv, sys.argv = sys.argv, ["ds_to_universal", "--input_folder", str(checkpoint), "--output_folder",
                                str(universal), "--num_extract_workers", "1", "--num_merge_workers", "1"]  # fmt: skip
    try:
        ds_to_universal.main(ds_to_universal.parse_arguments())
    finally:
        sys.argv = argv
