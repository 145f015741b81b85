"""State dicts of ``CPUOffloadOptimizer`` between two numberings of the parameters: the host
optimizer's (only the trained, offloaded parameters) and the one torch gives the parameters
as the user passed them (frozen ones count), which the optimizer without offload saves. So a
checkpoint moves freely between the two optimizers."""



def _host_to_given(given_groups: list[list], offloaded) -> list[int]:
    """Host parameter number -> the number of the same parameter as given."""
    mapping, given_index = [], 0
    for given in given_groups:
        for param in given:
            if param in offloaded:
                mapping.append(given_index)
            given_index += 1
    return mapping


def as_given(host: dict, given_groups: list[list], given_names: list, offloaded) -> dict:
    """The host optimizer's state dict ``host`` numbered as the parameters given
    (``given_names``: each group's parameter names, or ``None``; ``offloaded``: the trained
    parameters, which the host optimizer holds)."""
    mapping = _host_to_given(given_groups, offloaded)
    groups, given_index = [], 0
    for saved, given, names in zip(host["param_groups"], given_groups, given_names, strict=True):
        groups.append({**saved, "params": list(range(given_index, given_index + len(given)))})
        if names is not None:
            groups[-1]["param_names"] = list(names)
        given_index += len(given)
    state = {mapping[index]: value for index, value in host["state"].items()}
    return {"state": state, "param_groups": groups}


def as_host(state_dict: dict, given_groups: list[list], offloaded) -> dict:
    """``state_dict``, numbered as the parameters given, as the host optimizer's: state of
    parameters not offloaded (frozen here) is dropped. Raises ``ValueError`` in torch's words
    for groups that do not match."""
    groups = state_dict["param_groups"]
    if len(groups) != len(given_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    saved_to_host, host_groups, host_index = {}, [], 0
    for saved, given in zip(groups, given_groups):
        if len(saved["params"]) != len(given):
            raise ValueError("loaded state dict contains a parameter group that doesn't "
                             "match the size of optimizer's group")
        host_ids = []
        for saved_id, param in zip(saved["params"], given):
            if param in offloaded:
                saved_to_host[saved_id] = host_index
                host_ids.append(host_index)
                host_index += 1
        host_groups.append({**saved, "params": host_ids})
        if "param_names" in saved:
            host_groups[-1]["param_names"] = [
                name for name, param in zip(saved["param_names"], given) if param in offloaded]
    state = {saved_to_host[saved_id]: value for saved_id, value in state_dict["state"].items()
             if saved_id in saved_to_host}
    return {"state": state, "param_groups": host_groups}
