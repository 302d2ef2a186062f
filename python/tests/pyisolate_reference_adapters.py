"""pyisolate 0.10.2's own reference adapters, as its test suite defines them (the
installed package does not ship its tests), for composing with tensorwire's in
test_pyisolate.py. Copied from github.com/Comfy-Org/pyisolate at v0.10.2
(MIT License, Copyright (c) Comfy-Org): ``ReferenceAdapter`` from tests/harness/host.py
(the reference harness's adapter) and ``MockHostAdapter`` with ``MockRegistry`` and
``MockTestData`` from tests/fixtures/test_adapter.py (the reference IsolationAdapter),
docstrings shortened. Importable by module and name in the child, as pyisolate needs."""

from __future__ import annotations

import os
from typing import Any

from pyisolate._internal.rpc_protocol import AsyncRPC, ProxiedSingleton


class ReferenceAdapter:
    """Minimal adapter for the reference harness."""

    @property
    def identifier(self) -> str:
        return "reference_harness"

    def get_path_config(self, module_path: str) -> dict[str, Any] | None:
        return {"preferred_root": os.getcwd(), "additional_paths": []}

    def setup_child_environment(self, snapshot: dict[str, Any]) -> None:
        pass

    def register_serializers(self, registry: Any) -> None:
        try:
            import torch  # noqa: F401

            from pyisolate._internal.tensor_serializer import deserialize_tensor, serialize_tensor

            registry.register("torch.Tensor", serialize_tensor, deserialize_tensor)
        except Exception:
            pass

    def provide_rpc_services(self) -> list[type[ProxiedSingleton]]:
        return []

    def handle_api_registration(self, api: ProxiedSingleton, rpc: AsyncRPC) -> None:
        pass


class MockTestData:
    """Example custom type for serialization testing."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MockTestData):
            return False
        return bool(self.value == other.value)

    def __repr__(self) -> str:
        return f"MockTestData({self.value!r})"


class MockRegistry(ProxiedSingleton):
    """Example ProxiedSingleton for RPC testing: lives in the host."""

    def __init__(self) -> None:
        super().__init__()
        self._store: dict[str, Any] = {}
        self._counter = 0

    def register(self, obj: Any) -> str:
        obj_id = f"obj_{self._counter}"
        self._counter += 1
        self._store[obj_id] = obj
        return obj_id

    def get(self, obj_id: str) -> Any:
        return self._store.get(obj_id)

    def clear(self) -> None:
        self._store.clear()
        self._counter = 0


class MockHostAdapter:
    """Reference adapter implementation for testing and documentation."""

    def __init__(self, root_path: str = "/tmp/testhost") -> None:
        self._root = root_path
        self._extensions_dir = f"{root_path}/extensions"

    @property
    def identifier(self) -> str:
        return "testhost"

    def get_path_config(self, module_path: str) -> dict[str, Any]:
        return {"preferred_root": self._root, "additional_paths": [self._extensions_dir]}

    def setup_child_environment(self, snapshot: dict[str, Any]) -> None:
        pass

    def register_serializers(self, registry: Any) -> None:
        registry.register(
            "MockTestData",
            serializer=lambda d: {"__testdata__": True, "value": d.value},
            deserializer=lambda d: MockTestData(d["value"]) if d.get("__testdata__") else d,
        )

    def provide_rpc_services(self) -> list[type[ProxiedSingleton]]:
        return [MockRegistry]

    def handle_api_registration(self, api: ProxiedSingleton, rpc: AsyncRPC) -> None:
        return None

    def setup_web_directory(self, module: Any) -> None:
        return None

    def setup_child_event_hooks(self, rpc: AsyncRPC) -> None:
        return None

    def get_sandbox_system_paths(self) -> list[str]:
        return []

    def get_sandbox_gpu_patterns(self) -> list[str]:
        return []
