"""The ``accelerate launch`` target as a file: runs :mod:`trl_fused_cpo.train` (see it for the lifecycle).

    python scripts/train_cpo.py --config recipes/dev/tiny_cpo.yaml
    accelerate launch --config_file configs/single_gpu.yaml scripts/train_cpo.py \\
        --config recipes/llama3/8B_lora_cpo_single_device.yaml --beta 0.2 --max_steps 200

Same as ``trl-fused-cpo ...`` and ``python -m trl_fused_cpo.train ...``; needs the package (``pip install -e .``).
"""

from trl_fused_cpo.train import cli_main, main, make_parser  # noqa: F401  (main, make_parser: for importers)

if __name__ == "__main__":
    cli_main()
