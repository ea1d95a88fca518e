"""SGLang's ``/classify`` route (reward models, SGLang's ``--is-embedding`` servers): the logits of
a sequence-classification model for one text or a batch, so a real SGLang can stand in for ``noria
serve`` as a scalar reward model and the other way round.

Request: ``text`` (a string or a list) or ``input_ids`` (a list of ids or a list of such lists);
``rid`` (a string, or one per item); ``model`` and ``priority`` are accepted and ignored. Text is
tokenized as SGLang does (the tokenizer's ``encode``, special tokens as it adds them).

Answer, per item: ``{"embedding": [logit, ...], "meta_info": {"id": rid, "prompt_tokens": n,
"weight_version": v}}``; a list for a batch (a list of texts or of id lists), else one object. A
Bradley-Terry reward model has one logit: the reward is ``embedding[0]``.

Failure: a server whose model is not a sequence classifier answers 400 naming the route; an empty
or over-long row, a token outside the vocabulary or a bad field is a 400 naming the field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from noria.engine.protocol import RequestError
from noria.engine.server.parsing import INERT_NATIVE, check_ids, drop_inert, encode_text, per_item, read_json, reject_unknown

if TYPE_CHECKING:
    from noria.engine.server.app import EngineServer


class ClassifyApi:
    """``POST /classify`` over a ``SequenceClassifier`` engine."""

    FIELDS = {"text", "input_ids", "rid", "priority"}

    def __init__(self, server: EngineServer) -> None:
        self.s = server

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_route("POST", "/classify", self.classify)

    async def classify(self, request: web.Request) -> web.Response:
        engine = self.s.engine
        if not hasattr(engine, "classify"):
            raise RequestError("/classify: the served model is not a sequence classifier (a *ForSequenceClassification folder)")
        body = drop_inert(await read_json(request), INERT_NATIVE)
        reject_unknown(body, self.FIELDS)
        rows, batched = self.rows(body, engine)
        rids = [r or self.s.new_rid() for r in per_item(body.get("rid"), len(rows), "rid", str)]
        logits = await engine.classify(rows)
        out = [
            {"embedding": values, "meta_info": {"id": rid, "prompt_tokens": len(ids), "weight_version": str(engine.weight_version)}}
            for values, rid, ids in zip(logits, rids, rows)
        ]
        return web.json_response(out if batched else out[0])

    @staticmethod
    def rows(body: dict[str, Any], engine: Any) -> tuple[list[list[int]], bool]:
        """The token ids of every item, and whether the body was a batch."""
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise RequestError("/classify needs exactly one of text or input_ids")
        if text is not None:
            batched = isinstance(text, list)
            texts = text if batched else [text]
            if not texts or not all(isinstance(t, str) for t in texts):
                raise RequestError("text must be a string or a non-empty list of strings")
            if engine.tokenizer is None:
                raise RequestError("text: the served model has no tokenizer; send input_ids")
            name = "text[{}]" if batched else "text"
            rows = [encode_text(engine.tokenizer, t, name.format(i)) for i, t in enumerate(texts)]
        else:
            batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
            items = ids if batched else [ids]
            name = "input_ids[{}]" if batched else "input_ids"
            rows = [check_ids(row, name.format(i), engine.vocab_size) for i, row in enumerate(items)]
        for i, row in enumerate(rows):
            if not row:
                raise RequestError(f"text[{i}] has no tokens" if batched else "text has no tokens")
        return rows, batched
