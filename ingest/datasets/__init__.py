"""The dataset builders: planning, actor pools, ``build_dataset`` (RL) and ``build_sft_dataset`` (SFT)."""
