"""The parts of the fake Kubernetes API server (`harnessrl.testing.fake_kube_apiserver`, whose
docstring says what it does and where it differs from a real cluster): `objects` (kinds,
errors, selectors), `store` (objects, resourceVersions, watch history), `validation`,
`cluster` (API semantics, Job controller, garbage collector), `kubelet` (scheduler and pod
lifecycle), `runtime` (the kubelet's runtime interface; containers as local processes),
`container_runtime` (containers as Docker containers), `rbac` (tokens, RBAC, the
ownerReferences admission plugin), `http` (the REST surface)."""
