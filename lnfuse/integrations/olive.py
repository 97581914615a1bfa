"""lnfuse as a pass of Microsoft Olive (``pip install olive-ai``; lnfuse does not depend on it).

Olive finds a pass type through its package config, which a run replaces as a whole; so this module writes Olive's
own config plus the ``LnfuseFusion`` entry:

    python -m lnfuse.integrations.olive > lnfuse-olive.json
    olive run --config workflow.json --package-config lnfuse-olive.json

with ``"passes": {"fuse": {"type": "LnfuseFusion", "target": "ort"}}`` in the workflow (after OnnxConversion or
on an ONNXModel input). Options are ``fuse``'s: target, verify, only, skip, upgrade_opset.
"""

from __future__ import annotations

import json
from pathlib import Path

from lnfuse import terminal

try:
    from olive.hardware.accelerator import AcceleratorSpec
    from olive.model import ONNXModelHandler
    from olive.model.utils import resolve_onnx_path
    from olive.package_config import OlivePackageConfig
    from olive.passes import Pass
    from olive.passes.pass_config import BasePassConfig, PassConfigParam
except ImportError as missing:
    if __name__ != "__main__":
        raise
    terminal.say(f"lnfuse: error: this helper writes Olive's package config and needs Olive ({missing.name} is not "
                 "installed): pip install olive-ai", err=True)
    raise SystemExit(2) from None

from lnfuse.api import fuse


class LnfuseFusion(Pass):
    """Fuse normalization subgraphs with lnfuse; every rewrite verified in ONNX Runtime."""

    @classmethod
    def _default_config(cls, accelerator_spec: AcceleratorSpec) -> dict[str, PassConfigParam]:
        return {
            "target": PassConfigParam(type_=str, default_value="ort",
                                      description="ort: may write ONNX Runtime's fused ops; onnx: standard ops only"),
            "verify": PassConfigParam(type_=bool, default_value=True,
                                      description="verify every rewrite in ONNX Runtime"),
            "only": PassConfigParam(type_=list, default_value=None, description="run only these rules"),
            "skip": PassConfigParam(type_=list, default_value=None, description="do not run these rules"),
            "upgrade_opset": PassConfigParam(type_=bool, default_value=False,
                                             description="with target onnx: convert to the opset the fused ops "
                                                         "need, kept only if the whole model still agrees"),
        }

    def _run_for_config(self, model: ONNXModelHandler, config: type[BasePassConfig],
                        output_model_path: str) -> ONNXModelHandler:
        output = Path(resolve_onnx_path(output_model_path, Path(model.model_path).name))
        result = fuse(model.model_path, target=config.target, verify=config.verify, only=config.only,
                      skip=config.skip, upgrade_opset=config.upgrade_opset)
        result.save(output)
        return ONNXModelHandler(model_path=str(output.parent), onnx_file_name=output.name)


def package_config() -> dict:
    """Olive's own package config, plus ``LnfuseFusion``."""
    config = json.loads(Path(OlivePackageConfig.get_default_config_path()).read_text())
    config["passes"]["LnfuseFusion"] = {"module_path": "lnfuse.integrations.olive.LnfuseFusion",
                                        "supported_providers": ["*"],
                                        "supported_accelerators": ["*"], "supported_precisions": ["*"],
                                        "supported_algorithms": [], "supported_quantization_encodings": []}
    return config


if __name__ == "__main__":
    terminal.say_block(json.dumps(package_config(), indent=2))
