"""The HTTP door both servers stand behind, ``queueserve gateway`` and ``queueserve dashboard``
(the ``gateway`` extra: Starlette and uvicorn): bearer tokens (``auth``), request bodies
(``body``), browsers' cross-site writes (``crosssite``), the error shape of every answer
(``errors``), and the guard on connections (``connections``). Neither server imports the
other's modules: what both need is here.
"""
