-- wrk script: POST /directory/blend-lookup with a pool of pre-built bodies, checked answers.
--
--   BM_WRK_BODIES=bodies.jsonl BM_WRK_EXPECT=4 wrk -t1 -c16 -d5s -s wrk_lookup.lua http://127.0.0.1:PORT
--
-- BM_WRK_BODIES: a file with one JSON request body per line (each thread cycles through it,
-- starting at a different line). BM_WRK_EXPECT: matches every answer must contain; an answer
-- with fewer, or a status other than 200, counts as "bad". At the end one JSON line is
-- written: requests, duration, wrk's error counts, bad answers and latency percentiles (us).

local threads = {}

function setup(thread)
  thread:set("id", #threads)
  table.insert(threads, thread)
end

function init(args)
  bodies = {}
  for line in io.lines(os.getenv("BM_WRK_BODIES")) do
    bodies[#bodies + 1] = line
  end
  expect = tonumber(os.getenv("BM_WRK_EXPECT") or "0")
  headers = {["Content-Type"] = "application/json"}
  i = (id * 7) % #bodies
  bad = 0
end

function request()
  i = i % #bodies + 1
  return wrk.format("POST", "/directory/blend-lookup", headers, bodies[i])
end

function response(status, resp_headers, body)
  if status ~= 200 then
    bad = bad + 1
  elseif expect > 0 then
    local _, n = body:gsub('"cur_st"', "")
    if n < expect then bad = bad + 1 end
  end
end

function done(summary, latency, requests)
  local total_bad = 0
  for _, t in ipairs(threads) do total_bad = total_bad + t:get("bad") end
  local e = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "connect_errors": %d, "read_errors": %d, "write_errors": %d, ' ..
    '"status_errors": %d, "timeouts": %d, "bad_answers": %d, "p50_us": %d, "p90_us": %d, "p99_us": %d, ' ..
    '"max_us": %d, "mean_us": %.1f}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout, total_bad,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max, latency.mean))
end
