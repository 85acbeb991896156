// terra serve's page: plain JS, no build step, nothing from the network but this server.
"use strict";
const $ = (id) => document.getElementById(id);
let session = null, socket = null, path = [[0, 0]], busy = false;

function headers(json) {
  const h = json ? {"Content-Type": "application/json"} : {};
  const key = $("key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}
function status(text, error) { $("status").textContent = text; $("status").className = error ? "error" : ""; }
async function api(method, url, body) {
  const response = await fetch(url, {method, headers: headers(body !== undefined),
                                     body: body === undefined ? undefined : JSON.stringify(body)});
  if (!response.ok) {
    let message = response.status + " " + response.statusText;
    try { const e = (await response.json()).error; message = (e.field ? e.field + ": " : "") + e.message; } catch (_) {}
    throw new Error(message);
  }
  return response;
}
function fileAsBase64(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(String(reader.result).split(",", 2)[1]);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function start() {
  if (socket) socket.close();
  const body = {seed: Number($("seed").value) || 0, speed: Number($("speed").value) || 0};
  const files = $("upload").files;
  if (document.querySelector("input[name=ctx]:checked").value === "upload") {
    if (!files.length) { status("choose image files to upload first", true); return; }
    body.context = {images: await Promise.all(Array.from(files).map(fileAsBase64))};
  }
  status("starting…");
  try {
    session = await (await api("POST", "/v1/sessions", body)).json();
  } catch (e) { status(e.message, true); return; }
  path = session.path; drawPath();
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const key = $("key").value.trim();
  socket = new WebSocket(`${scheme}//${location.host}/v1/sessions/${session.id}/stream` + (key ? "?key=" + encodeURIComponent(key) : ""));
  socket.onmessage = (event) => onMessage(JSON.parse(event.data));
  // A refusal (4401 key, 4404 session, 4422 format) says why in its reason.
  socket.onclose = (event) => { status(event.code >= 4000 ? `closed: ${event.reason}` : "session closed", event.code >= 4000); socket = null; };
  socket.onopen = () => status("drive with the arrow keys (s or space: straight)");
}

function onMessage(m) {
  if (m.type === "frame") {
    const img = $("frame");
    if (m.image) img.src = `data:image/${m.format};base64,${m.image}`;  // another client's "tokens" step has none
    img.dataset.index = m.index;
    $("caption").textContent = `frame ${m.index}  ·  ${m.speed_kmh.toFixed(1)} km/h`;
    if (!m.replay) { path.push(m.position); drawPath(); busy = false; status(`frame ${m.index}`); }
  } else if (m.type === "reset") {
    path = m.session.path; drawPath(); busy = false; status("reset to the context");
  } else if (m.type === "error") {
    busy = false; status(`${m.field}: ${m.message}`, true);
  }
}

function act(action) {
  if (!socket || socket.readyState !== WebSocket.OPEN) { status("start a session first", true); return; }
  if (busy) return;  // one frame at a time: the next key press steers the next frame
  busy = true;
  status(action + "…");
  socket.send(JSON.stringify({action, frames: 1}));
}

function drawPath() {
  const c = $("path"), g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  const xs = path.map(p => p[0]), ys = path.map(p => p[1]);
  const span = Math.max(10, ...xs.map(Math.abs), ...ys.map(Math.abs)) * 1.15;
  const scale = (c.height - 20) / span;
  // x forward is up, y (left) is left; the start at the bottom centre.
  const px = (p) => [c.width / 2 - p[1] * scale, c.height - 10 - p[0] * scale];
  g.strokeStyle = "#ddd"; g.beginPath(); g.moveTo(c.width / 2, 0); g.lineTo(c.width / 2, c.height); g.stroke();
  g.strokeStyle = "#1a6"; g.lineWidth = 3; g.beginPath();
  path.forEach((p, i) => { const [u, v] = px(p); i ? g.lineTo(u, v) : g.moveTo(u, v); });
  g.stroke();
  const [u, v] = px(path[path.length - 1]);
  g.fillStyle = "#c33"; g.beginPath(); g.arc(u, v, 5, 0, 2 * Math.PI); g.fill();
}

async function download() {
  if (!session) { status("start a session first", true); return; }
  try {
    const blob = await (await api("GET", `/v1/sessions/${session.id}/video`)).blob();
    const a = document.createElement("a");
    a.href = URL.createObjectURL(blob); a.download = session.id + ".mp4"; a.click();
  } catch (e) { status(e.message, true); }
}

async function submitJobs() {
  const file = $("scenario-file").files[0];
  const text = file ? await file.text() : $("scenarios").value;
  const lines = text.split("\n").map(l => l.trim()).filter(l => l && !l.startsWith("#"));
  for (const [i, line] of lines.entries()) {
    let body;
    try { body = JSON.parse(line); } catch (e) { addJobRow({id: `line ${i + 1}`, status: "not JSON"}); continue; }
    try { addJobRow(await (await api("POST", "/v1/videos", body)).json()); }
    catch (e) { addJobRow({id: body.id || `line ${i + 1}`, status: e.message}); }
  }
}
const jobRows = new Map();
function addJobRow(job) {
  const row = document.createElement("tr");
  row.innerHTML = "<td></td><td></td><td><progress max='1' value='0'></progress></td><td></td>";
  row.cells[0].textContent = job.label || job.id;
  $("job-rows").appendChild(row);
  if (job.id && job.id.startsWith("v-")) jobRows.set(job.id, row);
  updateJobRow(row, job);
}
function updateJobRow(row, job) {
  row.cells[1].textContent = job.status;
  row.querySelector("progress").value = job.progress || 0;
  if (job.status === "done" && !row.cells[3].firstChild) {
    const link = document.createElement("a");
    link.textContent = "mp4"; link.href = "#";
    link.onclick = async (e) => {
      e.preventDefault();
      const blob = await (await api("GET", `/v1/videos/${job.id}/content`)).blob();
      const a = document.createElement("a"); a.href = URL.createObjectURL(blob); a.download = (job.label || job.id) + ".mp4"; a.click();
    };
    row.cells[3].appendChild(link);
  }
}
async function pollJobs() {
  for (const [id, row] of jobRows) {
    try {
      const job = await (await api("GET", `/v1/videos/${id}`)).json();
      updateJobRow(row, job);
      if (!["queued", "encoding", "running", "writing"].includes(job.status)) jobRows.delete(id);
    } catch (_) { jobRows.delete(id); }
  }
}
async function health() {
  try { const h = await (await fetch("/health")).json(); $("health").textContent = `${h.status} · ${h.backend} · ${h.sessions} session(s)`; }
  catch (_) { $("health").textContent = "unreachable"; }
}

const KEYS = {ArrowLeft: "left", ArrowRight: "right", ArrowUp: "faster", ArrowDown: "brake", s: "straight", " ": "straight"};
document.addEventListener("keydown", (e) => {
  if (e.target.tagName === "INPUT" || e.target.tagName === "TEXTAREA") return;
  const action = KEYS[e.key];
  if (action) { e.preventDefault(); act(action); }
});
document.querySelectorAll("[data-action]").forEach(b => b.addEventListener("click", () => act(b.dataset.action)));
$("start").addEventListener("click", start);
$("reset").addEventListener("click", () => socket && socket.send(JSON.stringify({type: "reset"})));
$("download").addEventListener("click", download);
$("submit-jobs").addEventListener("click", submitJobs);
setInterval(pollJobs, 1000);
setInterval(health, 5000);
health(); drawPath();
