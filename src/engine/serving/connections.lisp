;;;; Serving a connection a worker has taken: its stream started (a TLS
;;;; handshake stepped), then its turn of the request cycle, or of its
;;;; websocket, inside HUNCHENTOOT:PROCESS-CONNECTION, so that the :AROUND
;;;; methods of mixins run around it; then the connection parked, closed or
;;;; let go by the turn's outcome (request-cycle.lisp, websocket-turn.lisp).

(in-package #:hunchentoot-recycling-taskmaster)

(defun serve-connection (serving connection)
  "Serve CONNECTION, which the calling worker has taken from its readiness
set, inside HUNCHENTOOT:PROCESS-CONNECTION.  Whatever way that ends, the
connection is parked, closed or let go afterwards."
  (let ((engine (serving-engine serving))
        (set (serving-set serving))
        (worker (serving-worker serving)))
    (hold-connection worker connection)
    (unless (plain-connection-p connection)
      (forget-tls-errors))
    (unwind-protect
         (let ((started (or (connection-socket connection) (start-connection-stream engine connection))))
           (case started
             ((:input :output)
              (when (let-go-of-connection worker)
                (park-during-handshake engine set connection started)))
             ((nil))
             (t (hunchentoot:process-connection (serving-acceptor serving) (connection-socket connection)))))
      ;; Still held: PROCESS-CONNECTION was left by an error, or an :AROUND
      ;; method did not call the next method.
      (when (let-go-of-connection worker)
        (close-connection set connection)))))

(defmethod hunchentoot:process-connection ((acceptor parallel-acceptor) (socket connection-socket))
  "Serve the requests that have arrived on the connection SOCKET stands for,
which the calling worker holds, then park it, close it or let it go.
Called each time a worker takes the connection up, not once for its life:
:AROUND methods run around each such turn, in the worker's thread."
  (let* ((serving *serving*)
         (engine (serving-engine serving))
         (set (serving-set serving))
         ;; The connection SOCKET stands for, as SERVE-CONNECTION holds it:
         ;; reading SOCKET, made at accept and cold in the cache by the next
         ;; request, was 2% of a kept-alive request at 1,000 connections.
         (connection (worker-connection (serving-worker serving))))
    (with-connection-bindings ()
      (multiple-value-bind (outcome detail) (if (connection-websocket connection)
                                                (answer-websocket-frames serving connection)
                                                (answer-arrived-requests serving connection))
        (when (eq outcome :upgrade)
          (setf outcome (open-websocket serving connection detail)))
        (when (let-go-of-connection (serving-worker serving))
          (ecase outcome
            (:websocket (if (stopping-p engine)
                            (close-connection set connection)
                            (unless (eq (park-websocket (connection-websocket connection)) t)
                              (close-connection set connection))))
            (:park (park-or-end engine set connection (serving-buffer serving) detail))
            (:send-rest (park-until-writable engine set connection (serving-buffer serving) detail))
            (:read-body (park-until-body-arrives engine set connection))
            (:close (close-connection set connection))
            (:let-go (remove-connection set connection))
            (:refuse (if (eq detail :memory)
                         (refuse-for-memory set connection)
                         (refuse-and-close set connection detail)))))))))
