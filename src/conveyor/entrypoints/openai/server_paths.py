"""Paths on the server's disk that a client names (``lora_path`` of ``/v1/load_lora_adapter``;
any later route that reads a server-side path goes through here too). The operator picks the
trees clients may name (``--lora-root``); a path outside them is refused with one message
whatever is or is not there, and where no root is given no failure's reason reaches the client
(it goes to the server log): no answer tells a client what exists on the server's disk."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from conveyor.entrypoints.openai.errors import APIError, bad_request

logger = logging.getLogger("conveyor.serve")


@dataclass(frozen=True)
class ClientPaths:
    """Where clients may name paths: ``roots`` (resolved, absolute); empty: anywhere, but no
    failure's reason is shown to the client."""

    roots: tuple[str, ...] = ()

    @classmethod
    def of(cls, roots: list[str] | tuple[str, ...], flag: str) -> ClientPaths:
        """The roots as given on the command line; ValueError naming ``flag`` for one that is
        not a directory."""
        resolved = []
        for root in roots:
            if not os.path.isdir(root):
                raise ValueError(f"{flag} {root}: not a directory")
            resolved.append(os.path.realpath(root))
        return cls(tuple(resolved))

    def resolve(self, path: str, param: str, flag: str) -> str:
        """``path`` (absolute, or relative to the first root) with its symlinks resolved, when
        it lies under a root (or no root is set); otherwise a 400 that is the same whether or
        not the path exists."""
        if not self.roots:
            return path
        try:
            real = os.path.realpath(os.path.join(self.roots[0], path))
        except ValueError:  # a NUL byte
            real = None
        if real is not None and any(os.path.commonpath([real, root]) == root
                                    for root in self.roots):
            return real
        raise bad_request(f"'{param}' must name a path under the server's {flag}", param=param,
                          code="path_not_allowed")

    def failure(self, path: str, reason: str, param: str, flag: str) -> APIError:
        """The 400 for a path that could not be used: its reason when the path is under a root
        the operator opened to clients, otherwise one message (the reason is logged)."""
        if self.roots:
            return bad_request(reason, param=param)
        logger.warning("%s %r could not be used: %s", param, path, reason)
        return bad_request(f"nothing usable was found at '{param}' (the server log says why; "
                           f"with {flag} clients are told the reason)", param=param,
                           code="path_not_usable")
