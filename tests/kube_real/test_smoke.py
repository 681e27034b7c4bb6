from tests.kube_real.conftest import KubeEnv


async def test_a_pod_the_scheduler_binds_runs_on_its_node(kenv: KubeEnv) -> None:
    uid = await kenv.create("plain")
    pod = await kenv.wait_running("plain", uid)
    assert pod.spec.node_name == f"vmfence-{pod.metadata.annotations['vmfence.io/host']}"
    await kenv.check_runtime_matches_api()
    await kenv.core.delete_namespaced_pod("plain", kenv.ns)
    await kenv.wait_gone("plain")
    assert await kenv.vms("plain") == []
    await kenv.audit()
