"""The model families of `diffusion_rl.models`, one file each: what differs between them (prompt
encoding, latent layout, the transformer call, decoding) over the shared `FlowModel`
(diffusion_rl/flow_model.py). `diffusion_rl.models.load_flow_model` picks the class from the
pipeline class in model_index.json, and diffusion_rl.models re-exports each class.

    flux.py         FluxFlowModel        FluxPipeline (FLUX.1; also pixel-space models)
    flux2.py        Flux2FlowModel       Flux2Pipeline (FLUX.2)
    sd3.py          SD3FlowModel         StableDiffusion3Pipeline (SD3 / SD3.5)
    qwen_image.py   QwenImageFlowModel   QwenImagePipeline (Qwen-Image)
"""
