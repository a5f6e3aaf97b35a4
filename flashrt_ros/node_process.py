"""The installed flashrt node in a process of its own: used by the demos, benchmarks and tests."""

import os
import shutil
import signal
import subprocess
import sys

import yaml


class ManagedProcess:
    """A child process with its output in a log file, stopped by the PID we started."""

    def __init__(self, cmd, log_path, cwd):
        self.log_path = log_path
        self._log = open(log_path, 'a')
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd)

    @property
    def pid(self):
        """PID of the child process."""
        return self.proc.pid

    def stop(self, sig=signal.SIGINT, timeout=30.0):
        """Send `sig`, wait for the exit and return the exit code (SIGKILL after timeout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode

    def log(self):
        """Return what the process printed so far."""
        with open(self.log_path) as f:
            return f.read()


class NodeProcess(ManagedProcess):
    """Start `flashrt_node` with a parameter dict; stop it by PID with a signal."""

    def __init__(self, workdir, params, name='flashrt', extra_args=()):
        self.name = name
        os.makedirs(workdir, exist_ok=True)
        params_file = os.path.join(workdir, f'{name}.yaml')
        with open(params_file, 'w') as f:
            # '/**' matches this process's node whatever its name: the file is passed to it alone.
            yaml.safe_dump({'/**': {'ros__parameters': dict(params)}}, f)
        exe = shutil.which('flashrt_node')
        cmd = [exe] if exe else [sys.executable, '-m', 'flashrt_ros']
        cmd += ['--ros-args', '--params-file', params_file]
        if name != 'flashrt':
            cmd += ['-r', f'__node:={name}']
        # cwd outside the source tree, so `flashrt_ros` imports from the installed package
        # (the generated msg/srv/action modules exist only there).
        super().__init__(cmd + list(extra_args), os.path.join(workdir, f'{name}.log'), workdir)
