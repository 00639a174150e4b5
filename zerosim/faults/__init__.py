"""Why a job stalled, in words: the diagnosis the watchdog prints and ``zerosim flight`` reads back.

``comm/`` keeps what a collective needs to never wait forever (the watchdog's watched waits, the
progress table, the flight recorder); this package holds what reads those facts afterwards and
says which ranks hold a call up (``diagnosis.py``) and what a folder of flight files tells
(``flight_files.py``). Pure functions of plain states: no communicator, no MPI.
"""
