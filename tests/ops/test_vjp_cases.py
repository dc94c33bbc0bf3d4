def covered_ops():
    return set()
