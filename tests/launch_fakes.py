"""Stand-ins for Triton's JIT kernel, compiled kernel and driver: direct-relaunch logic tested without a GPU."""
import inspect


class FakeCompiled:
    """Stands in for Triton's compiled kernel: records what its launcher is called with."""
    function, packed_metadata = "function", "packed"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)

    def launch_metadata(self, *args):
        return None


class FakeParam:
    def __init__(self, name, default=inspect.Parameter.empty):
        self.name, self.default = name, default


class FakeJit:
    """Stands in for a JIT kernel with parameters `arg_names` (`defaults`: name -> default): each launch through
    it returns a new compiled kernel."""
    debug = None

    def __init__(self, arg_names, defaults=None):
        defaults = defaults or {}
        self.arg_names = list(arg_names)
        self.params = [FakeParam(n, defaults.get(n, inspect.Parameter.empty)) for n in self.arg_names]
        self.launches = []
        self.compiled = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches.append((grid, args, kwargs))
            self.compiled.append(FakeCompiled())
            return self.compiled[-1]
        return run


class FakeDriver:
    class active:
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: 1234)
