"""WavWriter: streams each request's PCM chunks into its own 16-bit mono WAV file (stdlib `wave`)."""

from __future__ import annotations

import logging
import os
import re
import threading
import wave

import torch

from .audio_stream import PcmChunk

log = logging.getLogger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def pcm16(samples: torch.Tensor) -> bytes:
    """float samples in [-1, 1] (clipped) -> little-endian 16-bit PCM bytes."""
    scaled = (samples.to(torch.float32).clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)
    return scaled.numpy().astype("<i2").tobytes()


class WavWriter:
    """on_audio(chunk) appends a request's samples to <directory>/<request id>.wav as they come and
    closes the file with its final chunk; paths[rid] names each finished file. A request that
    never ends (aborted, failed) leaves no file: close() removes what it had written."""

    def __init__(self, directory: str, sample_rate: int) -> None:
        self.directory, self.sample_rate = directory, sample_rate
        self.paths: dict[str, str] = {}  # finished requests' files
        self._open: dict[str, wave.Wave_write] = {}
        self._lock = threading.Lock()  # on_audio runs on the decoder's thread, close() on the caller's
        os.makedirs(directory, exist_ok=True)

    def path_for(self, request_id: str) -> str:
        return os.path.join(self.directory, _UNSAFE.sub("_", request_id) + ".wav")

    def on_audio(self, chunk: PcmChunk) -> None:
        with self._lock:
            handle = self._open.get(chunk.request_id)
            if handle is None:
                handle = self._open[chunk.request_id] = wave.open(self.path_for(chunk.request_id), "wb")
                handle.setnchannels(1)
                handle.setsampwidth(2)
                handle.setframerate(self.sample_rate)
            if len(chunk.samples):
                handle.writeframes(pcm16(chunk.samples))
            if chunk.is_final:
                handle.close()
                del self._open[chunk.request_id]
                self.paths[chunk.request_id] = self.path_for(chunk.request_id)

    def close(self) -> None:
        """Remove the files of requests whose stream did not end (nothing plays a cut utterance)."""
        with self._lock:
            for rid, handle in self._open.items():
                handle.close()
                os.remove(self.path_for(rid))
                log.warning("request %r: its audio did not end; removed %s", rid, self.path_for(rid))
            self._open.clear()
