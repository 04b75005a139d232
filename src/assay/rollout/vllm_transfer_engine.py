"""The server side of `assay_http`: a vLLM weight-transfer engine whose bytes arrive in the request.

Imported by vLLM's worker (never by assay itself) once `assay.rollout.weight_transfer.register`
has named it, when a server starts with `--weight-transfer-config '{"backend": "assay_http"}'`.
Each update is vLLM's layerwise reload: `start_weight_update` prepares it, every
`/update_weights` chunk goes through the model's own `load_weights` (checkpoint names, as
the learner's `named_parameters`), and `finish_weight_update` re-runs each layer's
post-load processing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from assay.rollout.weight_transfer import decode_chunk


@dataclass
class HTTPInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the bytes come with each request."""


@dataclass
class HTTPUpdateInfo(WeightTransferUpdateInfo):
    """One chunk (`assay.rollout.weight_transfer.encode_chunks`)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    data: str


class HTTPWeightTransferEngine(WeightTransferEngine[HTTPInitInfo, HTTPUpdateInfo]):
    """Weights in the `/update_weights` body, loaded with vLLM's layerwise reload."""

    init_info_cls = HTTPInitInfo
    update_info_cls = HTTPUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: HTTPInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: HTTPUpdateInfo) -> None:
        weights = decode_chunk(update_info.names, update_info.dtype_names, update_info.shapes, update_info.data)
        self.model.load_weights([(name, t.to(self.device)) for name, t in weights])

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        pass
