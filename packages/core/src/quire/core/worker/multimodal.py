"""The runner's side of multimodal prompts: each request's images, the encoder outputs, and a step's input
embeddings with the images' rows in place of their placeholder tokens."""

from __future__ import annotations

import numpy as np
import torch

from quire.core.sched.output import SchedulerOutput
from quire.core.wire import MultiModalFeature


class EncoderOutputs:
    """Encoder outputs by item identifier, computed when the scheduler says (``scheduled_encoder_inputs``)
    and dropped when it says (``freed_encoder_identifiers``).

    An output the scheduler did not schedule but a step needs (possible only after a preemption undid a
    step's plan) is computed on the spot: the scheduler's accounting bounds memory, never correctness.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model = model
        self.device = device
        self.features: dict[str, list[MultiModalFeature]] = {}  # per request id
        self.outputs: dict[str, torch.Tensor] = {}  # per identifier: [length, hidden]

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Take the step's new requests' images, drop freed outputs, then run the scheduled encoders."""
        for identifier in scheduler_output.freed_encoder_identifiers:
            self.outputs.pop(identifier, None)
        for data in scheduler_output.new_requests:
            if data.mm_features:
                self.features[data.request_id] = data.mm_features
        for request_id, indices in scheduler_output.scheduled_encoder_inputs.items():
            for index in indices:
                self._output(self.features[request_id][index])

    def remove_requests(self, request_ids) -> None:
        for request_id in request_ids:
            self.features.pop(request_id, None)

    def input_embeds(self, input_ids: torch.Tensor, request_ids: list[str], query_start_loc: np.ndarray,
                     positions: np.ndarray) -> torch.Tensor | None:
        """The step's input embeddings when any scheduled token is an image placeholder, else None.

        ``request_ids[i]`` owns tokens ``query_start_loc[i]:query_start_loc[i + 1]`` at ``positions``."""
        pieces = []
        for i, request_id in enumerate(request_ids):
            features = self.features.get(request_id)
            if not features:
                continue
            start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
            first = int(positions[start])
            last = first + (end - start)
            for feature in features:
                low, high = max(feature.offset, first), min(feature.offset + feature.length, last)
                if low < high:
                    rows = self._output(feature)[low - feature.offset:high - feature.offset]
                    pieces.append((start + low - first, rows))
        if not pieces:
            return None
        embeds = self.model.embed_input_ids(input_ids)
        for at, rows in pieces:
            embeds[at:at + rows.shape[0]] = rows
        return embeds

    def _output(self, feature: MultiModalFeature) -> torch.Tensor:
        output = self.outputs.get(feature.identifier)
        if output is None:
            data = {name: torch.from_numpy(tensor.to_array().copy()).to(self.device)
                    for name, tensor in feature.data.items()}
            output = self.model.embed_multimodal(feature.modality, data)
            if output.dim() != 2 or output.shape[0] != feature.length:
                raise ValueError(f"the encoder gave {tuple(output.shape)} for an item of {feature.length} "
                                 "placeholder tokens")
            self.outputs[feature.identifier] = output
        return output


class MRopePositions:
    """Rotary positions of models with multimodal rotary embeddings (``model.uses_mrope``: Qwen2-VL family).

    A prompt with images has three position rows (t, h, w), computed once per request by
    ``model.mrope_positions``; a token after the prompt at sequence index ``p`` has position ``p + delta`` on
    every row. Text-only prompts keep their sequence indices (delta 0).
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.prompts: dict[str, tuple[np.ndarray, int]] = {}  # per request id with images

    def add(self, request_id: str, prompt_token_ids: list[int], features: list[MultiModalFeature]) -> None:
        if features:
            grids = [tuple(int(v) for v in f.data["image_grid_thw"].to_array().reshape(-1)) for f in features]
            self.prompts[request_id] = self.model.mrope_positions(prompt_token_ids, grids)

    def remove_requests(self, request_ids) -> None:
        for request_id in request_ids:
            self.prompts.pop(request_id, None)

    def positions(self, request_ids: list[str], query_start_loc: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The step's rotary positions: ``positions`` (sequence indices, 1-D) where they are the rotary
        positions (text-only prompts), else per token: its prompt row of the three, or ``p + delta``; 1-D when
        the three rows agree (decode steps: the C++ decode stack and CUDA graphs take 1-D positions)."""
        rows = None
        for i, request_id in enumerate(request_ids):
            prompt = self.prompts.get(request_id)
            if prompt is None:
                continue
            if rows is None:
                rows = np.repeat(positions[None, :], 3, axis=0)
            prompt_positions, delta = prompt
            start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
            indices = positions[start:end]
            in_prompt = indices < prompt_positions.shape[1]
            clipped = np.minimum(indices, prompt_positions.shape[1] - 1)
            rows[:, start:end] = np.where(in_prompt, prompt_positions[:, clipped], indices + delta)
        if rows is None:
            return positions
        return rows[0].copy() if (rows == rows[0]).all() else rows
