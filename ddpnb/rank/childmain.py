"""The `__main__` of a process a rank starts with spawn or forkserver (`notebook.CHILD_MAIN`): the rank's notebook
classes and functions, rebuilt, so that pickle finds `__main__.MyDataset` here as it does in the rank."""

from ddpnb.rank.notebook import rebuild

rebuild(globals())
