"""The process listing, in both of its forms, and where "404 means gone" holds.

A process whose creation answer was lost is found again by its marker in
`GET …/processes`: `{"processes": [...]}`, or the paginated form of the
vendor's other lists, `{"data": [...], "pagination": {...}}`, page after page
(docs/protocol.md §5.3). Anything else fails closed. A 404 on DELETE means the
process is gone only from the origin that held it (docs/protocol.md §1, regions).
"""

from __future__ import annotations

import json
from typing import Any, Dict, List

import pytest
import requests
import responses
from support import NO_RETRY, PROCS, SANDBOX, SB, calls, make_client, ok, process_record

import createos_exec as cx


def paginated(records: List[Dict[str, Any]], offset: int, limit: int, total: int) -> Dict[str, Any]:
    page = records[offset : offset + limit]
    return {"data": page, "pagination": {"limit": limit, "offset": offset, "total": total}}


@pytest.mark.parametrize("page_size", [1, 2, 100])
def test_a_lost_creation_is_found_on_a_later_page(local_server, page_size):
    server = local_server(reading="alternative", list_page_size=page_size)
    with make_client(server) as client:
        for number in range(4):
            assert client.execute(SANDBOX, ["echo", str(number)]).exit_code == 0
        server.lose_create_response()
        result = client.execute(SANDBOX, ["echo", "found"])
    assert result.creation_recovered and result.stdout == "found\n"
    # The first page as the service chooses it, then the rest in pages of 500.
    offsets = [int(record.query.get("offset", 0)) for record in server.requests_to("list")]
    assert offsets == ([0] if page_size >= 5 else [0, page_size])
    assert len(server.processes()) == 5  # never a second one


def records_with_marker_on(request_body: bytes, count: int) -> List[Dict[str, Any]]:
    args = json.loads(request_body)["args"]
    others = [process_record("proc_%022d" % n, args=["-c", "x", "other"]) for n in range(count - 1)]
    return others + [process_record("proc_" + "m" * 22, args=args)]


def test_pages_are_followed_until_the_marker_is_found(rsps):
    created: Dict[str, bytes] = {}

    def create(request):
        created["body"] = request.body
        return (502, {}, "")

    def listing(request):
        records = records_with_marker_on(created["body"], 7)
        offset = int(request.params.get("offset", 0))
        limit = int(request.params.get("limit", 3))
        body = paginated(records, offset, min(limit, 3), len(records))
        return (200, {}, json.dumps(ok(body)))

    rsps.add_callback(responses.POST, PROCS, callback=create)
    rsps.add_callback(responses.GET, PROCS, callback=listing)
    rsps.add(
        responses.GET,
        PROCS + "/proc_" + "m" * 22 + "/connect",
        body=b'{"type":"exit","exit_code":0}\n',
    )
    result = make_client(retry=NO_RETRY).execute(SB, ["true"])
    assert result.creation_recovered and result.process_id == "proc_" + "m" * 22
    pages = [int(call.request.params.get("offset", 0)) for call in calls(rsps, "GET", PROCS)]
    assert pages == [0, 3, 6]


@pytest.mark.parametrize(
    "listing",
    [
        None,
        [],
        {"processes": "many"},
        {"data": []},  # no pagination
        {"data": [], "pagination": {"total": "3"}},
        {"data": {}, "pagination": {"total": 0}},
        {"data": [], "pagination": {"total": 3, "offset": 0}},  # empty before its end
        {"data": [], "pagination": {"total": 1, "offset": 5}},  # not the page asked for
    ],
    ids=repr,
)
def test_a_listing_in_no_known_form_fails_closed(listing):
    with pytest.raises(cx.ProtocolError):
        cx._listing_page(listing, 0)


def test_a_listing_that_never_ends_is_read_for_a_bounded_number_of_pages(rsps):
    rsps.add(responses.POST, PROCS, status=503)

    def endless(request):
        offset = int(request.params.get("offset", 0))
        page = {
            "data": [process_record("proc_%022d" % offset)],
            "pagination": {"total": 10**9, "offset": offset},
        }
        return (200, {}, json.dumps(ok(page)))

    rsps.add_callback(responses.GET, PROCS, callback=endless)
    with pytest.raises(cx.CleanupError) as caught:
        make_client(retry=NO_RETRY).execute(SB, ["true"])
    assert caught.value.creation_unconfirmed
    assert isinstance(caught.value.__cause__, cx.ProtocolError)
    listings = [call for call in rsps.calls if call.request.method == "GET"]
    assert len(listings) == cx._LISTING_PAGES


def test_a_process_this_origin_never_had_is_the_404_itself_with_nothing_to_destroy(server, caplog):
    # Another region's API, or a wrong id: one lookup says so before anything
    # is followed, so there is no tree to contain and no warning to give.
    caplog.set_level("WARNING", logger="createos_exec")
    with make_client(server) as client, pytest.raises(cx.APIError) as caught:
        client.attach(SANDBOX, "proc_" + "n" * 22)
    assert caught.value.status == 404 and caught.value.operation == "process lookup"
    assert "wrong id" in str(caught.value)
    assert server.requests_to("delete") == [] and server.requests_to("connect") == []
    assert caplog.records == []


def test_the_sandbox_answers_its_view_and_404_for_one_this_origin_does_not_have(server):
    with make_client(server) as client:
        view = cx._Sandbox(client._transport, SANDBOX).view(cx._ENDLESS)
        with pytest.raises(cx.APIError, match="no sandbox with this id here") as caught:
            cx._Sandbox(client._transport, "sb_nowhere").view(cx._ENDLESS)
    assert (view["id"], view["status"]) == (SANDBOX, "running")
    assert (caught.value.status, caught.value.operation) == (404, "sandbox lookup")


def test_404_on_delete_is_gone_where_the_process_was_held(server):
    started = requests.post(
        server.url + "/v1/sandboxes/%s/processes" % SANDBOX,
        json={"cmd": "sleep", "args": ["30"]},
        headers={"X-Api-Key": server.api_key},
        timeout=10,
    )
    process_id = started.json()["data"]["process_id"]
    # The lookup answers for the process on this origin: a 404 on its
    # DELETE (a service that forgot it) then counts as gone.
    server.fail("delete", 404)
    # The process lives on behind the 404, so the reading of what its
    # termination printed lasts until the cleanup deadline: keep that short.
    with make_client(server, cleanup_timeout=1.0) as client:
        result = client.attach(SANDBOX, process_id, timeout=0.3)
    assert result.timed_out
    assert [record.status for record in server.requests_to("delete")] == [404]
