"""The local stack and the operator command line: `harnessrl up` and its verbs (`cli`), the
stack of child processes on this machine (`stack`, `engine`, `supervisor`), the verbs on a
detached stack (`operate`), the training job and its progress (`train_job`, `progress`) and
the run report (`report`). Installed with the `cli` extra; no service imports it
(tests/test_packaging.py checks).
"""
