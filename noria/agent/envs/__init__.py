"""Environment libraries from PyPI, attached at Noria's agent-function layer (``rollout.agent_fn``, ``noria.plugins``).

Modules::

    verifiers_env.py  ``VerifiersAgent``: runs one episode of a ``verifiers`` environment (v1 API:
                      taskset + env + harness) per Noria sample, its model calls going to the
                      session server; ``NoriaChatHarness``: an in-process chat harness for it
    guess_number.py   a multi-turn ``verifiers`` environment (guess the number, the game engine
                      playing the user) and its agent function ``agent``

These modules import ``verifiers`` (``pip install -e ".[test]"`` installs it); nothing else in
Noria imports them.
"""
