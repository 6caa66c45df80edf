-- Shared by the wrk scripts in this folder (loaded with dofile, not require, so
-- that wrk can be started from any working directory).
--
-- Every script counts response status codes per thread and, when wrk finishes,
-- prints one line `WRK_JSON {...}` that bench/api_vs_mlflow.py parses: exact
-- percentiles in microseconds, error counts, and the status histogram. wrk's own
-- text report (--latency) is printed above it as usual.

local M = {}

function M.read_file(path)
  local f = assert(io.open(path, "rb"), "cannot open " .. tostring(path))
  local data = f:read("*a")
  f:close()
  return data
end

function M.read_lines(path)
  local lines = {}
  for line in io.lines(path) do
    line = line:gsub("%s+$", "")
    if line ~= "" then lines[#lines + 1] = line end
  end
  assert(#lines > 0, "no lines in " .. tostring(path))
  return lines
end

-- Extra request headers come from args of the form "Header-Name: value".
function M.apply_headers(args, first)
  for i = first, #args do
    local name, value = args[i]:match("^([^:]+):%s*(.*)$")
    assert(name, "header argument must look like 'Name: value', got " .. args[i])
    wrk.headers[name] = value
  end
end

local threads = {}

function M.setup(thread)
  thread:set("thread_index", #threads)
  threads[#threads + 1] = thread
end

statuses = {}

function M.response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
end

function M.done(summary, latency, requests)
  local merged = {}
  for _, t in ipairs(threads) do
    local s = t:get("statuses")
    if s then
      for code, n in pairs(s) do merged[code] = (merged[code] or 0) + n end
    end
  end
  local codes = {}
  for code, n in pairs(merged) do codes[#codes + 1] = string.format('"%d": %d', code, n) end
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests": %d, "duration_us": %d, "bytes": %d, ' ..
    '"errors": {"connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}, ' ..
    '"latency_us": {"min": %d, "mean": %.1f, "stdev": %.1f, "max": %d, ' ..
    '"p50": %d, "p90": %d, "p99": %d, "p999": %d}, "statuses": {%s}}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency.min, latency.mean, latency.stdev, latency.max,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), table.concat(codes, ", ")))
end

return M
