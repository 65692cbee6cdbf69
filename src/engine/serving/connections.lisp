;;;; Serving a connection a worker has taken: its stream started (a TLS
;;;; handshake stepped), then its turn of the request cycle, or of its
;;;; websocket, inside HUNCHENTOOT:PROCESS-CONNECTION, so that the :AROUND
;;;; methods of mixins run around it; then the connection parked, closed or
;;;; let go by the turn's outcome (request-cycle.lisp, websocket-turn.lisp),
;;;; through the readiness set's face (readiness/face.lisp, END-TURN).

(in-package #:hunchentoot-recycling-taskmaster)

(defun serve-connection (serving connection)
  "Serve CONNECTION, which the calling worker has taken from its readiness
set, inside HUNCHENTOOT:PROCESS-CONNECTION.  Whatever way that ends, the
connection is parked, closed or let go afterwards (END-TURN)."
  (let ((engine (serving-engine serving))
        (set (serving-set serving))
        (worker (serving-worker serving)))
    (hold-connection worker connection)
    ;; A new connection has no stream yet: its handshake is to come when
    ;; the acceptor speaks TLS.
    (when (if (connection-stream connection)
              (not (plain-connection-p connection))
              (hunchentoot:acceptor-ssl-p (serving-acceptor serving)))
      (forget-tls-errors))
    (unwind-protect
         (let ((socket (start-connection-socket engine connection)))
           (case socket
             ((:input :output)
              (when (let-go-of-connection worker)
                (end-turn set connection nil :handshake socket)))
             ((nil))
             (t (hunchentoot:process-connection (serving-acceptor serving) socket))))
      ;; Still held: PROCESS-CONNECTION was left by an error, or an :AROUND
      ;; method did not call the next method.
      (when (let-go-of-connection worker)
        (end-turn set connection nil :close nil)))))

(defmethod hunchentoot:process-connection ((acceptor parallel-acceptor) (socket connection-socket))
  "Serve the requests that have arrived on the connection SOCKET stands for,
which the calling worker holds, then park it, close it or let it go.
Called each time a worker takes the connection up, not once for its life:
:AROUND methods run around each such turn, in the worker's thread."
  (let* ((serving *serving*)
         ;; The connection SOCKET stands for, as SERVE-CONNECTION holds it:
         ;; reading SOCKET, made at accept and cold in the cache by the next
         ;; request, was 2% of a kept-alive request at 1,000 connections.
         (connection (worker-connection (serving-worker serving))))
    (with-connection-bindings ()
      (multiple-value-bind (outcome detail) (ecase (held-connection-kind connection)
                                                  (:websocket (answer-websocket-frames serving connection))
                                                  (:http2 (answer-http2-frames serving connection nil))
                                                  (:deferred (answer-deferred-reply serving connection))
                                                  (:event-stream (event-stream-turn connection))
                                                  ((nil) (answer-arrived-requests serving connection)))
        (case outcome
          (:upgrade (setf (values outcome detail) (open-websocket serving connection detail)))
          ;; From the request cycle: the connection speaks HTTP/2 from now.
          (:http2 (unless (held-connection-kind connection)
                    (setf (values outcome detail) (answer-http2-frames serving connection detail)))))
        (when (let-go-of-connection (serving-worker serving))
          (end-turn (serving-set serving) connection (serving-buffer serving) outcome detail))))))
