-- wrk's script for reservoir bench-service: POST /v1/reservations as fast as the
-- connections allow, each answer's request id written to a file of the thread's own
-- (the bench deletes them afterwards), an Idempotency-Key of its own per request when
-- RESERVOIR_WRK_KEYED is 1. done() prints one JSON line the bench reads.

local keyed = os.getenv("RESERVOIR_WRK_KEYED") == "1"
local body = os.getenv("RESERVOIR_WRK_BODY") or '{"vcpus": 1, "memory_mb": 64}'
local threads = {}
local made = 0

function setup(thread)
  made = made + 1
  thread:set("number", made)
  table.insert(threads, thread)
end

local out
local sent = 0
local prefix

function init(args)
  out = io.open(args[1] .. "." .. number, "w")
  prefix = "wrk-" .. args[2] .. "-" .. number .. "-"
  wrk.method = "POST"
  wrk.body = body
  wrk.headers["Content-Type"] = "application/json"
end

function request()
  if keyed then
    sent = sent + 1
    return wrk.format(nil, nil, {["Idempotency-Key"] = prefix .. sent})
  end
  return wrk.request()
end

function response(status, headers, answer)
  local id = answer:match('"request_id":"([^"]+)"')
  if id then
    out:write(id, "\n")
    out:flush()
  end
end

function done(summary, latency, requests)
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "non_2xx": %d, "errors": %d, ' ..
    '"p50_us": %d, "p99_us": %d}\n',
    summary.requests, summary.duration, summary.errors.status,
    summary.errors.connect + summary.errors.read + summary.errors.write +
      summary.errors.timeout,
    latency:percentile(50), latency:percentile(99)))
end
