"""The interactive session behind ``%clorch`` and ``%%distributed``.

``launcher`` owns the rank processes, ``relay`` owns their channels, ``display`` owns what the
notebook shows, ``protocol`` names what crosses between them, ``comms`` carries widgets' comms between the
front end and the ranks, and ``session`` composes them.
``worker`` and ``bootstrap`` run inside the ranks; ``wire`` verifies what the ranks send.
"""
