;;;; The access log, written by the engine when the acceptor logs access as
;;;; Hunchentoot does (DEFAULT-ACCESS-LOG-P): the same entry, built without
;;;; FORMAT (access-log-line.lisp) and kept with the destination's others
;;;; to be written together (access-log-batch.lisp).  An application's own
;;;; HUNCHENTOOT:ACCEPTOR-LOG-ACCESS method is called as on Hunchentoot's
;;;; acceptor.

(in-package #:hunchentoot-recycling-taskmaster)

(defun default-access-log-p (acceptor)
  "True when the only HUNCHENTOOT:ACCEPTOR-LOG-ACCESS methods for ACCEPTOR
are Hunchentoot's and this library's :AROUND: the engine then writes the
entry Hunchentoot's method would."
  (let ((generic-function #'hunchentoot:acceptor-log-access))
    (equal (applicable-methods generic-function (class-of acceptor))
           (list (find-method generic-function '(:around) (list (find-class 'parallel-acceptor)))
                 (find-method generic-function '() (list (find-class 'hunchentoot:acceptor)))))))

(defun serving-access-log-default-p (serving acceptor)
  "DEFAULT-ACCESS-LOG-P of ACCEPTOR, SERVING's, asked again only when a
method is added or removed: a method defined at the REPL on a running
server is called from its next request on, as on Hunchentoot's acceptor.
Kept by each worker, so that acceptors of two classes in one process (HTTP
and HTTPS) never ask it anew at each request."
  (let ((methods (generic-function-methods-list #'hunchentoot:acceptor-log-access)))
    (if (eq methods (serving-access-log-methods serving))
        (serving-access-log-answer serving)
        (setf (serving-access-log-methods serving) methods
              (serving-access-log-answer serving) (default-access-log-p acceptor)))))

(defun engine-writes-access-log-p (acceptor)
  (if *serving*
      (serving-access-log-default-p *serving* acceptor)
      (default-access-log-p acceptor)))

(defun access-log-of (destination)
  "The ACCESS-LOG of DESTINATION, kept by the worker for the next entry."
  (let ((serving *serving*))
    (cond ((null serving) (find-access-log destination))
          ((eq destination (serving-access-log-destination serving)) (serving-access-log serving))
          (t (let ((log (find-access-log destination)))
               (setf (serving-access-log-destination serving) destination
                     (serving-access-log serving) log))))))

(defun write-access-log-reporting (log acceptor &optional entry-octets (entry-end 0))
  "FLUSH-ACCESS-LOG, with a line in ACCEPTOR's message log when LOG's writes
begin to fail and when they succeed again."
  (multiple-value-bind (report detail) (flush-access-log log entry-octets entry-end)
    (case report
      (:failing
       (log-safely acceptor :error "The access log ~A cannot be written (~A): its entries are lost, counted, until it can be."
                   (access-log-destination log) detail))
      (:written-again
       (log-safely acceptor :warning "The access log ~A is written again; ~:D entries were lost."
                   (access-log-destination log) detail)))))

(defun keep-entry-in-access-log (log head acceptor)
  "Keep the entry built in HEAD in LOG: written within
+ACCESS-LOG-FLUSH-MILLISECONDS+ by a worker's timer, at once when the buffer
is full or when no worker keeps it (an entry for a refusal the maintenance
made)."
  (let ((octets (reply-head-octets head))
        (end (reply-head-end head)))
    (case (keep-access-log-entry log octets end)
      ((t))
      (:first (if *serving*
                  (funcall (serving-schedule-log-write *serving*)
                           (lambda () (write-access-log-reporting log acceptor)))
                  (write-access-log-reporting log acceptor)))
      (:full (write-access-log-reporting log acceptor))
      ((nil) (write-access-log-reporting log acceptor octets end)))))

(defun write-access-log-entry (acceptor return-code)
  "Keep the entry of the current request's reply RETURN-CODE for ACCEPTOR's
access log destination: the line Hunchentoot's ACCEPTOR-LOG-ACCESS writes,
or the JSON object of ACCEPTOR-ACCESS-LOG-FORMAT :JSON."
  (let ((destination (hunchentoot:acceptor-access-log-destination acceptor)))
    (when destination
      (let* ((serving *serving*)
             (request hunchentoot:*request*)
             (head (if serving (serving-log-entry serving) (make-reply-head)))
             (remote-addr (hunchentoot:remote-addr request))
             (forwarded-for (hunchentoot:header-in :x-forwarded-for request))
             (user (hunchentoot:authorization request))
             (method (hunchentoot:request-method request))
             (script-name (hunchentoot:script-name request))
             (query-string (hunchentoot:query-string request))
             (protocol (hunchentoot:server-protocol request))
             (content-length (hunchentoot:content-length* hunchentoot:*reply*))
             (referer (hunchentoot:referer request))
             (user-agent (hunchentoot:user-agent request)))
        (setf (reply-head-end head) 0)
        (if (if (and serving (eq acceptor (serving-acceptor serving)))
                (serving-access-log-json-p serving)
                (eq (acceptor-access-log-format acceptor) :json))
            (push-access-log-json head remote-addr forwarded-for user (json-log-time-octets) method script-name
                                  query-string protocol return-code content-length
                                  (and serving (request-microseconds-so-far (serving-worker serving)))
                                  referer user-agent)
            (push-access-log-line head remote-addr forwarded-for user (access-log-time-octets) method script-name
                                  query-string protocol return-code content-length referer user-agent))
        (keep-entry-in-access-log (access-log-of destination) head acceptor)))))

(defmacro noting-access-log-failure ((acceptor return-code) &body body)
  "Run BODY, which writes the access log entry of the reply RETURN-CODE: one
that fails costs its entry and a line in the message log, never the reply.
Hunchentoot's entry fails on a client's Authorization header whose Basic
credentials are not base64 (HUNCHENTOOT:AUTHORIZATION signals), and on its
own acceptor that request then goes unanswered."
  `(handler-case (progn ,@body)
     (error (condition)
       (log-safely ,acceptor :warning "No access log entry for the ~D reply to ~A: ~A"
                   ,return-code
                   (and (boundp 'hunchentoot:*request*) hunchentoot:*request*
                        (hunchentoot:remote-addr hunchentoot:*request*))
                   condition))))

(defun log-access (return-code)
  "Write the access log entry of the reply RETURN-CODE: the engine's own
(WRITE-ACCESS-LOG-ENTRY) when the acceptor logs as Hunchentoot does, else
through HUNCHENTOOT:ACCEPTOR-LOG-ACCESS.  Not through the generic function
in the first case: its call conses its keyword arguments, 32 bytes a request
(bench/profiles/2026-11-28-per-core.txt)."
  (let ((acceptor hunchentoot:*acceptor*))
    (if (engine-writes-access-log-p acceptor)
        (when (hunchentoot:acceptor-access-log-destination acceptor)
          (noting-access-log-failure (acceptor return-code)
            (write-access-log-entry acceptor return-code)))
        (hunchentoot:acceptor-log-access acceptor :return-code return-code))))

(defun write-every-access-log (acceptor)
  "Write what every access log keeps (at STOP)."
  (dolist (log (every-access-log))
    (write-access-log-reporting log acceptor)))

(defun write-overdue-access-logs (acceptor)
  "Write what the access logs whose timer was lost keep (OVERDUE-ACCESS-LOGS)."
  (dolist (log (overdue-access-logs))
    (write-access-log-reporting log acceptor)))
