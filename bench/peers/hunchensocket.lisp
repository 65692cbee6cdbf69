;;;; hunchensocket on Hunchentoot's own acceptor, the websocket load's peer
;;;; (bench/websockets.lisp): loaded from ../shared/vendor into an SBCL of
;;;; its own.  It serves what ours does in that load: GET /yo, GET /gc (a
;;;; full garbage collection, so that its RSS is what it keeps), /ws/echo
;;;; (each message back to its sender) and /ws/chat and /ws/room (each text
;;;; message to every client of the resource).

(defpackage #:bench-peer
  (:use #:cl)
  (:export #:serve))

(in-package #:bench-peer)

(defclass echo-resource (hunchensocket:websocket-resource) ())

(defmethod hunchensocket:text-message-received ((resource echo-resource) client message)
  (hunchensocket:send-text-message client message))

(defclass chat-resource (hunchensocket:websocket-resource) ())

(defmethod hunchensocket:text-message-received ((resource chat-resource) client message)
  (declare (ignore client))
  (dolist (peer (hunchensocket:clients resource))
    (ignore-errors (hunchensocket:send-text-message peer message))))

(defvar *resources*
  (list (cons "/ws/echo" (make-instance 'echo-resource))
        (cons "/ws/chat" (make-instance 'chat-resource))
        (cons "/ws/room" (make-instance 'chat-resource))))

(defun find-resource (request)
  (cdr (assoc (hunchentoot:script-name request) *resources* :test #'string=)))

(pushnew 'find-resource hunchensocket:*websocket-dispatch-table*)

(defclass websocket-easy-acceptor (hunchensocket:websocket-acceptor hunchentoot:easy-acceptor) ())

(hunchentoot:define-easy-handler (yo :uri "/yo") ()
  (setf (hunchentoot:content-type*) "text/plain")
  "Hey!")

(hunchentoot:define-easy-handler (gc :uri "/gc") ()
  (setf (hunchentoot:content-type*) "text/plain")
  (sb-ext:gc :full t)
  "done")

(defun serve (port delay-ms)
  "Serve on 127.0.0.1:PORT until killed."
  (declare (ignore delay-ms))
  (hunchentoot:start (make-instance 'websocket-easy-acceptor :address "127.0.0.1" :port port
                                                             :access-log-destination nil
                                                             :message-log-destination nil))
  (loop (sleep 3600)))
