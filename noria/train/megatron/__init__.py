"""The Megatron-Core trainer backend (``train.backend: megatron``); see docs/megatron.md.

Modules::

    model.py     everything that imports megatron-core: availability and refusal, parallel state,
                 ModelArgs -> TransformerConfig, the local layer spec with packed core attention,
                 the packed forward to hidden states and the gathered output layer
    backend.py   MegatronBackend: the TrainBackend contract (compute_logprobs, train_step,
                 state_dict_for_sync, save / load, export_hf) over GPTModel, DDP and Megatron's optimizer

The HF <-> Megatron names and layouts live with the models (``noria.models.megatron``): pure tensor
code the CPU suite checks. The config section is ``noria.config.megatron``. Importing this package imports neither megatron-core
nor the trainer: import the module you need.
"""
