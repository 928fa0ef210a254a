"""The image reward atoms of `diffusion_rl.rewards`, one file a kind of reward, and what they share:

    clip_score.py   clip_score_atom: CLIP score with an open_clip model
    preference.py   preference_atom: a preference model (a transformers CLIP model, PickScore's
                    format, or the user's own scorer from a Python file)
    common.py       the model cache, batch inputs (to_rgb), argument checks, path resolution
    tiny_clip.py    tiny random open_clip and transformers CLIP models for tests

diffusion_rl.rewards reads the config specs into these atoms and re-exports every name: import
them from there. Its docstring defines the scores.
"""
