"""The build (setup.py and its helpers in tools/): finding the CUDA toolkit the way a user expects
(tools/cuda_toolkit.py), the checks that skip a CUDA build that cannot succeed, SYNCBN_CUDA, an
optional extension whose build fails leaving the others built (a real compiler error, with small
extensions so that it takes seconds; tools/build_failure.py), and torch's shared C++ runtime in
every extension (tools/cxx_runtime.py). The same failure with the real kernels, and an import
from outside the repository, are checked by tools/check_build.sh in CI."""
from __future__ import annotations

import glob
import importlib.util
import os
import re
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_setup():
    spec = importlib.util.spec_from_file_location("syncbn_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)  # setup() itself runs only as __main__
    return module


setup_py = load_setup()  # puts tools/ on sys.path, as for the build
import build_failure  # noqa: E402
import cuda_toolkit  # noqa: E402
import cxx_runtime  # noqa: E402


def executable(path, text: str) -> str:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def fake_toolkit(root, with_runtime: bool = True) -> str:
    """A folder shaped like a CUDA toolkit: bin/nvcc (not a script) and lib64/libcudart.so."""
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "nvcc").write_bytes(b"\x7fELF not really")
    (root / "bin" / "nvcc").chmod(0o755)
    (root / "lib64").mkdir()
    if with_runtime:
        (root / "lib64" / "libcudart.so").write_bytes(b"")
    return str(root)


def test_nvcc_is_followed_through_links_and_wrapper_scripts(tmp_path) -> None:
    home = fake_toolkit(tmp_path / "cuda-13.0")
    link = tmp_path / "cuda"
    link.symlink_to(home)
    wrapper = executable(tmp_path / "nvcc", f'#!/bin/sh\nexec {link}/bin/nvcc "$@"\n')
    assert cuda_toolkit.real_nvcc(wrapper) == os.path.join(home, "bin", "nvcc")
    twice = executable(tmp_path / "nvcc2", f"#!/bin/sh\n{wrapper} \"$@\"\n")  # a wrapper of the wrapper
    assert cuda_toolkit.real_nvcc(twice) == os.path.join(home, "bin", "nvcc")


def test_toolkit_from_the_environment_then_from_nvcc(tmp_path, monkeypatch) -> None:
    home = fake_toolkit(tmp_path / "cuda-13.0")
    bin_dir = tmp_path / "wrappers"
    bin_dir.mkdir()
    executable(bin_dir / "nvcc", f'#!/bin/sh\nexec {home}/bin/nvcc "$@"\n')
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    found = cuda_toolkit.find_toolkit()
    assert found.home == home and "nvcc on the PATH" in found.found_by and home in found.found_by
    monkeypatch.setenv("CUDA_PATH", str(tmp_path))
    assert cuda_toolkit.find_toolkit().found_by == "$CUDA_PATH"
    monkeypatch.setenv("CUDA_HOME", home)
    assert cuda_toolkit.find_toolkit() == cuda_toolkit.Toolkit(home, "$CUDA_HOME")


def test_a_cuda_build_that_cannot_succeed_is_detected_before_compiling(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "not a CUDA build" in cuda_toolkit.cuda_blocker(None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert "no CUDA toolkit" in cuda_toolkit.cuda_blocker(None)
    bare = cuda_toolkit.Toolkit(fake_toolkit(tmp_path / "bare", with_runtime=False), "$CUDA_HOME")
    assert "no runtime library (libcudart)" in cuda_toolkit.cuda_blocker(bare)
    monkeypatch.setattr(cuda_toolkit, "unsupported_archs", lambda toolkit, archs: ["7.0"])
    complete = cuda_toolkit.Toolkit(fake_toolkit(tmp_path / "complete"), "$CUDA_HOME")
    assert "cannot build for 7.0" in cuda_toolkit.cuda_blocker(complete)


def test_syncbn_cuda_skips_or_requires(monkeypatch) -> None:
    monkeypatch.setenv("SYNCBN_CUDA", "0")
    assert setup_py.cuda_extensions() == []
    monkeypatch.setenv("SYNCBN_CUDA", "1")
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(SystemExit, match="SYNCBN_CUDA=1.*not a CUDA build"):
        setup_py.cuda_extensions()
    monkeypatch.setenv("SYNCBN_CUDA", "maybe")
    with pytest.raises(SystemExit, match="must be 0, 1 or unset"):
        setup_py.cuda_mode()


def test_first_error_line_skips_command_lines() -> None:
    log = textwrap.dedent("""\
        [1/2] c++ -c a.cpp -Werror=return-type
        g++ -shared a.o -lcudart -o a.so
        /usr/bin/ld: cannot find -lcudart: No such file or directory
        collect2: error: ld returned 1 exit status
    """)
    assert build_failure.first_error_line(log) == "/usr/bin/ld: cannot find -lcudart: No such file or directory"


def test_a_failing_optional_extension_leaves_the_others_built(tmp_path) -> None:
    # a tiny project built with our BuildExtension: one required extension, one optional whose
    # source does not compile (as a CUDA build that fails)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "good.cpp").write_text(textwrap.dedent("""\
        #include <Python.h>
        static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "good", nullptr, -1, nullptr};
        PyMODINIT_FUNC PyInit_good(void) { return PyModule_Create(&module); }
    """))
    (tmp_path / "bad.cpp").write_text("this is not C++;\n")
    (tmp_path / "build.py").write_text(textwrap.dedent(f"""\
        import importlib.util, sys
        from setuptools import setup
        from torch.utils.cpp_extension import CppExtension
        spec = importlib.util.spec_from_file_location("syncbn_setup", {os.path.join(ROOT, "setup.py")!r})
        syncbn_setup = importlib.util.module_from_spec(spec)
        sys.modules["syncbn_setup"] = syncbn_setup; spec.loader.exec_module(syncbn_setup)
        syncbn_setup.ROOT = {str(tmp_path)!r}  # where failure notes go
        bad = CppExtension("pkg._C_cuda", ["bad.cpp"])
        bad.optional = True
        setup(name="pkg", packages=["pkg"], ext_modules=[CppExtension("pkg.good", ["good.cpp"]), bad],
              cmdclass={{"build_ext": syncbn_setup.BuildExtension}})
    """))
    done = subprocess.run(
        [sys.executable, "build.py", "build_ext", "--inplace"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the CUDA kernels (pkg._C_cuda) failed to build" in done.stderr
    assert re.search(r"First error: \S*bad.cpp:1:1: error:", done.stderr), done.stderr
    assert "SYNCBN_CUDA=0" in done.stderr
    built = list((tmp_path / "pkg").glob("good*.so"))
    assert built and not list((tmp_path / "pkg").glob("_C_cuda*.so"))
    note = tmp_path / "pkg" / "_C_cuda.build-failure.txt"
    assert "failed to build" in note.read_text()
    imported = subprocess.run([sys.executable, "-c", "import pkg.good"], cwd=tmp_path, capture_output=True, text=True)
    assert imported.returncode == 0, imported.stderr


FORMAT_MODULE = textwrap.dedent("""\
    #include <Python.h>
    #include <sstream>
    static PyObject* format(PyObject*, PyObject* arg) {
      std::ostringstream text;  // a number formatted, as a TORCH_CHECK message does
      text << PyLong_AsLong(arg);
      return PyUnicode_FromString(text.str().c_str());
    }
    static PyMethodDef methods[] = {{"format", format, METH_O, nullptr}, {nullptr, nullptr, 0, nullptr}};
    static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fmt", nullptr, -1, methods};
    PyMODINIT_FUNC PyInit_fmt(void) { return PyModule_Create(&module); }
""")


@pytest.mark.exhaustive
@pytest.mark.skipif(cxx_runtime.loaded_cxx_runtime() is None, reason="torch loaded no shared libstdc++ here")
def test_a_compiler_that_links_the_cxx_runtime_statically_still_links_torchs(tmp_path) -> None:
    # CC and CXX wrap the system's compilers with -static-libstdc++, as a relocated GCC does: the
    # link arguments that setup.py gives every extension give it torch's shared runtime all the
    # same, and tools/cxx_runtime.py names an extension built without them
    for name, compiler in (("cc", "gcc"), ("cxx", "g++")):
        (tmp_path / name).write_text(f'#!/bin/sh\nexec {compiler} -static-libstdc++ "$@"\n')
        (tmp_path / name).chmod(0o755)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "fmt.cpp").write_text(FORMAT_MODULE)
    (tmp_path / "build.py").write_text(textwrap.dedent(f"""\
        import importlib.util, os, sys
        from setuptools import setup
        from torch.utils.cpp_extension import CppExtension
        spec = importlib.util.spec_from_file_location("syncbn_setup", {os.path.join(ROOT, "setup.py")!r})
        syncbn_setup = importlib.util.module_from_spec(spec)
        sys.modules["syncbn_setup"] = syncbn_setup; spec.loader.exec_module(syncbn_setup)
        link = syncbn_setup.cxx_runtime_link_args() if os.environ.get("LINK_TORCHS_RUNTIME") else []
        setup(name="pkg", packages=["pkg"], ext_modules=[CppExtension("pkg.fmt", ["fmt.cpp"], extra_link_args=link)],
              cmdclass={{"build_ext": syncbn_setup.BuildExtension}})
    """))
    env = {**os.environ, "CC": str(tmp_path / "cc"), "CXX": str(tmp_path / "cxx")}
    check = [sys.executable, os.path.join(ROOT, "tools", "cxx_runtime.py")]

    def build(**extra: str) -> str:
        done = subprocess.run([sys.executable, "build.py", "build_ext", "--inplace", "--force"], cwd=tmp_path,
                              env={**env, **extra}, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        (built,) = (tmp_path / "pkg").glob("fmt*.so")
        return str(built)

    static = build()
    assert cxx_runtime.cxx_runtime_definitions(static) != []
    named = subprocess.run([*check, static], env=env, capture_output=True, text=True, timeout=120)
    assert named.returncode == 1 and "carries its own copy of the C++ runtime" in named.stderr, named.stderr
    linked = build(LINK_TORCHS_RUNTIME="1")
    assert cxx_runtime.cxx_runtime_definitions(linked) == []
    passed = subprocess.run([*check, linked], capture_output=True, text=True, timeout=120)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    formatted = subprocess.run([sys.executable, "-c", "import torch, pkg.fmt; print(pkg.fmt.format(12345))"],
                               cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert formatted.stdout.strip() == "12345", formatted.stderr


def test_every_extension_links_torchs_cxx_runtime(tmp_path, monkeypatch) -> None:
    # the build does not inspect what it linked, so each extension's link line must name the runtime
    runtime = cxx_runtime.cxx_runtime_link_args()
    assert all(arg in setup_py.cpu_extension("DEFAULT").extra_link_args for arg in runtime)
    home = fake_toolkit(tmp_path / "cuda-13.0")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(setup_py, "cuda_blocker", lambda toolkit: None)
    monkeypatch.setattr(setup_py, "forget_failure_notes", lambda paths: None)  # the repository's note stays
    monkeypatch.setattr(setup_py.cpp_extension, "CUDA_HOME", setup_py.cpp_extension.CUDA_HOME)
    for name, value in (("SYNCBN_CUDA", "auto"), ("CUDA_HOME", home), ("TORCH_CUDA_ARCH_LIST", "9.0")):
        monkeypatch.setenv(name, value)
    (cuda,) = setup_py.cuda_extensions()
    assert all(arg in cuda.extra_link_args for arg in runtime) and cuda.optional
    assert "--use_fast_math" not in cuda.extra_compile_args["nvcc"] and "-g0" in cuda.extra_compile_args["cxx"]


def test_the_built_kernels_use_torchs_cxx_runtime() -> None:
    if cxx_runtime.loaded_cxx_runtime() is None:
        pytest.skip("torch loaded no shared libstdc++ here")
    built = glob.glob(os.path.join(ROOT, "functions", "_C_*.so"))
    if not built:
        pytest.skip("the kernels are not built in place")
    for path in built:
        assert cxx_runtime.cxx_runtime_definitions(path) == [], path


def test_a_fresh_interpreter_serves_the_compiled_cpu_kernels_and_torchs_cuda_ops() -> None:
    # what serves by default, whatever the environment holds; our CUDA kernels only when asked
    # for with use_kernels, and where they are not built, asking says why
    import json

    code = (
        "import json; from syncbn import backend_info; from syncbn.functions import use_kernels\n"
        "info = backend_info()\n"
        "try:\n    use_kernels(cuda='compiled'); asked = backend_info()['cuda']\n"
        "except RuntimeError as error:\n    asked = str(error)\n"
        "print(json.dumps([info, asked]))"
    )
    env = {**os.environ, "SYNCBN_KERNELS": "reference", "SYNCBN_CUDA_KERNELS": "compiled"}  # no longer read
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    info, asked = json.loads(done.stdout.strip().splitlines()[-1])
    assert info["cpu"].startswith("compiled-cpu-") and info["cuda"] == "torch-cuda-ops", info
    if importlib.util.find_spec("syncbn.functions._C_cuda") is not None:
        assert asked == "compiled-cuda"
    else:
        assert "compiled CUDA kernels are not usable" in asked and "_C_cuda" in asked, asked


PTXAS_LOG = """\
ptxas info    : Compiling entry function '_Z4wideRf' for 'sm_90'
ptxas info    : Function properties for _Z4wideRf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 200 registers, used 0 barriers, 380 bytes cmem[0]
ptxas info    : Compiling entry function '_Z5loosePf' for 'sm_90'
ptxas info    : Function properties for _Z5loosePf
    0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers, 1024 bytes smem, 380 bytes cmem[0]
ptxas info    : Compiling entry function '_Z4finePf' for 'sm_90'
ptxas info    : Function properties for _Z4finePf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 16384 bytes smem, 380 bytes cmem[0]
"""

PTX = """\
.version 8.0
.target sm_90
.address_size 64
.visible .entry _Z4wideRf(
\t.param .u64 _Z4wideRf_param_0
)
.maxntid 512, 1, 1
{
\tret;
}
.visible .entry _Z5loosePf(
\t.param .u64 _Z5loosePf_param_0
)
{
\tret;
}
.visible .entry _Z4finePf(
\t.param .u64 _Z4finePf_param_0
)
.maxntid 256, 1, 1
.minnctapersm 1
{
\tret;
}
"""


def test_the_cuda_resource_check_names_every_kernel_that_cannot_launch_or_spills(tmp_path) -> None:
    # what tools/check_cuda.sh runs on nvcc's -Xptxas -v log and kept PTX: a kernel whose
    # registers x declared block exceed a block's 65,536 registers, one that declares no block
    # size and spills; the one that fits passes
    kernels = tmp_path / "reductions.cu"
    kernels.mkdir()
    (kernels / "ptxas.log").write_text(PTXAS_LOG)
    (kernels / "reductions.ptx").write_text(PTX)
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "cuda_resources.py"), str(kernels)], capture_output=True, text=True)
    assert run.returncode == 1, run.stdout + run.stderr
    failed = [line for line in run.stderr.splitlines() if "FAILED" in line]
    assert len(failed) == 3, run.stderr
    assert any("wide" in line and "200 registers x 512 threads = 102400" in line for line in failed)
    assert any("loose" in line and "declares no block size" in line for line in failed)
    assert any("loose" in line and "spills (8 bytes stored, 8 loaded)" in line for line in failed)
    assert not any("fine" in line for line in failed)
    assert re.search(r"sm_90\s+64\s+256\s+16384\s+16384\s+0/0\s+fine", run.stdout), run.stdout
