;;;; The connection engine: what a worker does between two looks at the pool.
;;;; The pool (src/pool/) calls only these generic functions; an engine is
;;;; made once, at the first HUNCHENTOOT:START, by MAKE-CONNECTION-ENGINE of
;;;; the taskmaster, and the pool never asks which one it has.  The readiness
;;;; engine (engine/readiness/, engine/serving/) is the one there is.

(in-package #:hunchentoot-recycling-taskmaster)

(defclass connection-engine ()
  ((taskmaster
    :initarg :taskmaster :reader engine-taskmaster
    :documentation "The RECYCLING-TASKMASTER whose workers this engine serves."))
  (:documentation "How a pool's workers find work and serve connections.
Made once per taskmaster and kept from run to run, so that what it counts
covers the taskmaster's whole life; ENGINE-START and ENGINE-FINISH bracket
each run."))

(defgeneric make-connection-engine (taskmaster)
  (:documentation "A new engine for TASKMASTER, not yet started: the
readiness engine for a RECYCLING-TASKMASTER.  A taskmaster class of another
engine specializes it."))

(defgeneric engine-start (engine)
  (:documentation "Get ENGINE ready for a run of its taskmaster's acceptor,
whose socket is listening: called by HUNCHENTOOT:START before any worker is
made."))

(defgeneric engine-run-worker (engine worker)
  (:documentation "Serve with the calling thread, WORKER's, until the pool is
stopping or WORKER is surplus (BEGIN-WAITING or NOTE-WAIT-TIMED-OUT said it
is to end); then return.  The engine reports WORKER's waits and requests to
the pool with the functions of pool/worker.lisp (BEGIN-WAITING, NOTE-...),
and holds each connection it serves with HOLD-CONNECTION until
LET-GO-OF-CONNECTION."))

(defgeneric engine-wake-workers (engine)
  (:documentation "Make every worker waiting in ENGINE, now and later, return
from its wait to look at the pool.  Called by HUNCHENTOOT:STOP after it has
marked the pool stopping."))

(defgeneric engine-drain (engine deadline)
  (:documentation "Stop taking new connections, and wait until DEADLINE
(internal real time) for those already taken that have not been answered
once -- accepted, or being accepted as it stopped, their request not
complete yet -- to be answered, while the workers go on serving.  True
when none is left.  Called by a soft HUNCHENTOOT:STOP before it marks the
pool stopping, so that a connection the acceptor took is not closed before
its first request: what waits in the kernel's accept queue stays there,
for whoever listens on the socket next."))

(defgeneric engine-close-idle-connections (engine)
  (:documentation "Close every connection that no worker holds, at once and
without waiting on any client.  Called by HUNCHENTOOT:STOP."))

(defgeneric engine-cut-connection (engine worker)
  (:documentation "Make whatever WORKER waits on in the connection it holds
(a read, a write, a TLS handshake) return at once with an error, so that
WORKER unwinds by itself, in Lisp.  Does nothing when WORKER holds no
connection.  Never interrupts WORKER's thread: a handler that computes or
sleeps goes on until it next touches its connection."))

(defgeneric engine-cut-handshake (engine worker)
  (:documentation "ENGINE-CUT-CONNECTION when the connection WORKER holds has
no stream yet: its TLS handshake is under way, perhaps inside the
acceptor's own HUNCHENTOOT:INITIALIZE-CONNECTION-STREAM, which waits on the
client outside any request, and a stopping pool would close it unanswered
anyway.  Does nothing otherwise."))

(defgeneric engine-work-waiting-p (engine)
  (:documentation "True when ENGINE has something ready to serve that no
worker has taken yet.  Asked by the thread-making thread while no worker
waits, to tell whether one more would find work; must not wait."))

(defgeneric engine-maintenance-interval (engine)
  (:documentation "Seconds between two calls of ENGINE-MAINTAIN."))

(defgeneric engine-maintain (engine)
  (:documentation "ENGINE's periodic work, done by the thread-making thread
every ENGINE-MAINTENANCE-INTERVAL seconds while the acceptor runs (the
readiness engine ends connections past their deadline).  Must not wait on
any client."))

(defgeneric engine-statistics (engine)
  (:documentation "A fresh plist of what ENGINE holds now and what it has
counted since it was made, for TASKMASTER-STATISTICS."))

(defgeneric engine-finish (engine)
  (:documentation "Close whatever ENGINE still holds and release what it
opened at ENGINE-START.  Called by HUNCHENTOOT:STOP once every worker has
ended."))

(defgeneric engine-abandon (engine)
  (:documentation "Close every connection ENGINE has, whoever held it, and
release what it opened.  Called by ABANDON-ACCEPTOR once the workers are
destroyed; must work on an engine in any state, started or not."))
