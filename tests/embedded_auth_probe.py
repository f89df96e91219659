"""Run by tests/test_security.py in a process of its own: an embedded Ray as `amalia run` starts it (no
RAY_AUTH_MODE set), a task run on it, then every port its processes listen on off loopback probed as an outsider
would (no token): the gRPC services Ray serves there (GCS, the raylet's node manager and object manager, each
worker's core worker, the dashboard agent's log service, which reads any log of the node) and the HTTP ones (a job
submitted to an agent). Prints JSON: {"task": …, "ports": [{process, ip, port, answers}]}."""

from __future__ import annotations

import json
import os
import socket

import grpc
import httpx
import psutil


def main() -> None:
    from amalia_ray.cluster.local import ray_session

    with ray_session(num_cpus=2):
        import ray
        from ray.core.generated import (core_worker_pb2, core_worker_pb2_grpc, gcs_service_pb2,
                                        gcs_service_pb2_grpc, node_manager_pb2, node_manager_pb2_grpc,
                                        reporter_pb2, reporter_pb2_grpc)

        task = ray.get(ray.remote(lambda: "ran").remote())
        routable = ray.util.get_node_ip_address()
        probes = {
            "gcs": lambda ch: gcs_service_pb2_grpc.NodeInfoGcsServiceStub(ch).GetAllNodeInfo(
                gcs_service_pb2.GetAllNodeInfoRequest(), timeout=5),
            "node manager": lambda ch: node_manager_pb2_grpc.NodeManagerServiceStub(ch).GetNodeStats(
                node_manager_pb2.GetNodeStatsRequest(), timeout=5),
            "core worker": lambda ch: core_worker_pb2_grpc.CoreWorkerServiceStub(ch).GetCoreWorkerStats(
                core_worker_pb2.GetCoreWorkerStatsRequest(), timeout=5),
            # Ray ships no Python stub for it: an empty message is a valid request with every field at its default
            "object manager": lambda ch: ch.unary_unary("/ray.rpc.ObjectManagerService/Pull",
                                                        request_serializer=bytes, response_deserializer=bytes)(
                b"", timeout=5),
            "agent logs": lambda ch: reporter_pb2_grpc.LogServiceStub(ch).ListLogs(
                reporter_pb2.ListLogsRequest(glob_filter="*"), timeout=5),
        }
        tree = {p.pid: _name(p) for p in psutil.Process().children(recursive=True)}
        ports = []
        for c in psutil.net_connections("inet"):
            if c.status != "LISTEN" or c.pid not in tree or c.laddr.ip in ("127.0.0.1", "::1"):
                continue
            answers = {}
            with grpc.insecure_channel(f"{routable}:{c.laddr.port}") as channel:
                for service, call in probes.items():
                    try:
                        call(channel)
                        answers[service] = "OK"
                    except grpc.RpcError as e:
                        answers[service] = e.code().name
            try:  # Prometheus metrics: names of tasks, actors and deployments, never their data or code
                answers["http metrics"] = httpx.get(f"http://{routable}:{c.laddr.port}/metrics", timeout=5).status_code
            except httpx.HTTPError as e:
                answers["http metrics"] = type(e).__name__
            try:
                r = httpx.post(f"http://{routable}:{c.laddr.port}/api/job_agent/jobs/",
                               json={"entrypoint": "touch /tmp/pwned"}, timeout=5)
                answers["http job"] = r.status_code
            except httpx.HTTPError as e:
                answers["http job"] = type(e).__name__
            ports.append({"process": tree[c.pid], "ip": c.laddr.ip, "port": c.laddr.port, "answers": answers})
    print(json.dumps({"task": task, "host": socket.gethostname(), "mode": os.environ.get("RAY_AUTH_MODE"),
                      "ports": ports}))


def _name(process: psutil.Process) -> str:
    """The process's name, or for a Python process the script it runs (dashboard.py, monitor.py)."""
    scripts = [os.path.basename(a) for a in process.cmdline()[1:] if a.endswith(".py")]
    return scripts[0] if process.name().startswith("python") and scripts else process.name()


if __name__ == "__main__":
    main()
