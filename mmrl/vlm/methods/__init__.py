"""The vision-language methods; importing this package registers them with the core loop."""

from mmrl.vlm.methods import axpo, cora, dspo, pacg, vppo  # noqa: F401
