"""LoRA vs full fine-tuning of MiniLM on IMDb (accuracy gap, trainable share, step time, memory, fused inference).

    nohup .venv/bin/python -m fxforge.benchmarks.bench_lora_finetune > /tmp/bench_lora_finetune.log 2>&1 &

The measurement is examples/lora_finetune.py (MASE tutorial 2); this entry point runs it with the same
defaults (2,000 train / 1,000 test reviews, max_length 128, 1 epoch) and prints its RATIO lines.
Several minutes on 2 CPU cores.
"""

from __future__ import annotations

from ..examples.lora_finetune import main

if __name__ == "__main__":
    raise SystemExit(main())
