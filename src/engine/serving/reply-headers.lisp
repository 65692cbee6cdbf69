;;;; The headers the engine sets on a reply as START-OUTPUT sets them --
;;;; Connection, Keep-Alive, Server, Date, Content-Length -- and what is done
;;;; to a reply's headers as they are read to be sent.
;;;;
;;;; Each header is set through Hunchentoot's (SETF HEADER-OUT) and read
;;;; through its HEADERS-OUT, unless those generic functions have only
;;;; Hunchentoot's methods and this library's (PLAIN-HEADER-METHODS-P): then
;;;; a PARALLEL-REPLY's headers are set and read in its slot, as those
;;;; methods would, and the values checked as they are written into the
;;;; head rather than in a pass of their own: without six generic function
;;;; calls a request and the second pass, the reply head's share of a 0 ms
;;;; request's user time fell from 20% to 14%
;;;; (bench/profiles/2026-11-29-reply-headers.txt).  A method defined on
;;;; either, at any time, is called from the next request on.

(in-package #:hunchentoot-recycling-taskmaster)

(defun decide-streamed-reply-coding ()
  "Before a streamed reply's head is sent: whether it is coded from here on
(CODE-STREAMED-REPLY), decided once."
  (when (and *serving* (not *deciding-reply-coding*)
             (serving-compression *serving*))
    (let ((*deciding-reply-coding* t))
      (code-streamed-reply hunchentoot:*request*))))

(defun name-keep-alive-timeout (headers)
  "Make the Keep-Alive header among HEADERS, if any, name the acceptor's
KEEP-ALIVE-TIMEOUT: START-OUTPUT writes timeout=<read timeout>, but a
parallel acceptor closes an idle connection after KEEP-ALIVE-TIMEOUT, and a
client told otherwise would send its next request on a connection being
closed."
  (let ((entry (and *serving* (assoc :keep-alive headers))))
    (when entry
      (setf (cdr entry) (serving-keep-alive-header-value *serving*)))))

(defmethod hunchentoot:headers-out :around ((reply parallel-reply))
  "The headers as they are read to be written (the headers are then marked
sent: HUNCHENTOOT:START-OUTPUT marks them just before it reads them): coded
if streamed (DECIDE-STREAMED-REPLY-CODING), refused when a value is unsafe
(REFUSE-UNSAFE-HEADER-VALUES), Keep-Alive naming the acceptor's
KEEP-ALIVE-TIMEOUT (NAME-KEEP-ALIVE-TIMEOUT).  Hunchentoot's (SETF
HEADER-OUT) cannot be specialized on the reply, its optional argument:
hence the reader."
  (when (headers-sent-p)
    (decide-streamed-reply-coding))
  (let ((headers (call-next-method)))
    (when (headers-sent-p)
      (refuse-unsafe-header-values reply)
      (name-keep-alive-timeout headers))
    headers))

;;; Setting and reading them.

(defun plain-header-methods-p ()
  "True when (SETF HUNCHENTOOT:HEADER-OUT) has only Hunchentoot's methods
and HUNCHENTOOT:HEADERS-OUT only Hunchentoot's reader and this library's
:AROUND, so that a PARALLEL-REPLY's headers may be set and read in its slot."
  (flet ((only-methods-p (generic-function &rest qualifiers-and-specializers)
           (let ((methods (generic-function-methods-list generic-function)))
             (and (= (length methods) (length qualifiers-and-specializers))
                  (loop for (qualifiers specializers) in qualifiers-and-specializers
                        always (member (find-method generic-function qualifiers specializers nil)
                                       methods))))))
    (and (only-methods-p #'(setf hunchentoot:header-out)
                         '(() (t symbol)) '(() (t string))
                         '((:after) (t (eql :content-length))) '((:after) (t (eql :content-type))))
         (only-methods-p #'hunchentoot:headers-out
                         '(() (hunchentoot:reply)) '((:around) (parallel-reply))))))

(defun serving-plain-header-methods-p (serving)
  "PLAIN-HEADER-METHODS-P, SERVING's, asked again only when a method of
either generic function is added or removed."
  (let ((setter-methods (generic-function-methods-list #'(setf hunchentoot:header-out)))
        (reader-methods (generic-function-methods-list #'hunchentoot:headers-out)))
    (if (and (eq setter-methods (serving-header-setter-methods serving))
             (eq reader-methods (serving-header-reader-methods serving)))
        (serving-plain-header-methods-answer serving)
        (setf (serving-header-setter-methods serving) setter-methods
              (serving-header-reader-methods serving) reader-methods
              (serving-plain-header-methods-answer serving) (plain-header-methods-p)))))

(defun slot-reply ()
  "The current reply when its headers may be set and read in its slot: a
PARALLEL-REPLY in a worker of the engine, while PLAIN-HEADER-METHODS-P.
NIL otherwise.  Asked once a reply, and passed to the functions below."
  (and *serving*
       (typep hunchentoot:*reply* 'parallel-reply)
       (serving-plain-header-methods-p *serving*)
       hunchentoot:*reply*))

(defun reply-header (name slot-reply)
  "HUNCHENTOOT:HEADER-OUT of NAME, a keyword, of the current reply, which is
SLOT-REPLY unless that is NIL (SLOT-REPLY)."
  (if slot-reply
      (cdr (assoc name (reply-headers slot-reply)))
      (hunchentoot:header-out name)))

(defun reply-header-p (name slot-reply)
  "True when the current reply has a header NAME, NIL-valued or not."
  (if slot-reply
      (assoc name (reply-headers slot-reply))
      (header-out-set-p name)))

(defun (setf reply-header) (value name slot-reply)
  "Set the header NAME, a keyword, of the current reply to VALUE, as
Hunchentoot's (SETF HUNCHENTOOT:HEADER-OUT) does: Content-Length and
Content-Type also in their slots."
  (if slot-reply
      (let ((entry (assoc name (reply-headers slot-reply))))
        (if entry
            (setf (cdr entry) value)
            (push (cons name value) (reply-headers slot-reply)))
        (case name
          (:content-length (setf (reply-content-length slot-reply) value))
          (:content-type (setf (reply-content-type slot-reply) value)))
        value)
      (setf (hunchentoot:header-out name) value)))

(defun headers-to-send (reply slot-reply)
  "REPLY's headers, marked sent, as they are written: through
HUNCHENTOOT:HEADERS-OUT, checked, or, from SLOT-REPLY (see SLOT-REPLY), as
the :AROUND method above reads them but unchecked.  Second value: true when
the values are still to be checked, as they are written (PUSH-REPLY-HEAD)."
  (setf (headers-sent-p) t)
  (cond (slot-reply
         (decide-streamed-reply-coding)
         (let ((headers (reply-headers slot-reply)))
           (name-keep-alive-timeout headers)
           (values headers t)))
        (t
         (let ((headers (hunchentoot:headers-out reply)))
           (unless (typep reply 'parallel-reply)
             (refuse-unsafe-header-values reply))
           (values headers nil)))))

;;; The headers START-OUTPUT sets.

(defun connection-option-p (value option)
  "True when OPTION is one of the comma-separated options of the Connection
header VALUE, compared without case, as Hunchentoot's KEEP-ALIVE-P reads
them: whitespace around each comma is not part of an option, whitespace at
the ends of VALUE is."
  (declare (type simple-string option))
  ;; Loops over the string's own kind: by POSITION, POSITION-IF-NOT and
  ;; STRING-EQUAL, generic, this was 0.29 us of a request naming "close"
  ;; (bench/profiles/2026-12-02-session-at-the-same-moment.txt); browsers
  ;; name "keep-alive" on every request, and it is asked twice.
  (let ((length (length option)))
    (with-string-kind (value)
      (flet ((whitespacep (char)
               (or (char= char #\Space) (char= char #\Tab) (char= char #\Newline) (char= char #\Return)
                   (char= char #\Page))))
        (loop with end = (length value)
              for start = 0 then (1+ comma)
              for comma = (or (loop for index from start below end
                                    when (char= (char value index) #\,) return index)
                              end)
              do (let ((option-start (if (plusp start)
                                         (or (loop for index from start below comma
                                                   unless (whitespacep (char value index)) return index)
                                             comma)
                                         start))
                       (option-end (if (< comma end)
                                       (1+ (or (loop for index from (1- comma) downto start
                                                     unless (whitespacep (char value index)) return index)
                                               (1- start)))
                                       comma)))
                   (when (and (= (- option-end option-start) length)
                              (loop for index from option-start below option-end
                                    for option-index from 0
                                    always (char-equal (char value index) (schar option option-index))))
                     (return t)))
              while (< comma end))))))

(defun keep-alive-reply-p (request)
  "What Hunchentoot's KEEP-ALIVE-P answers for REQUEST: true unless its
headers or the acceptor forbid a persistent connection; second value, true
when the client asked for one explicitly; third, REQUEST's protocol.
Hunchentoot splits the Connection header with a regular expression on every
request; this reads it in place."
  (let* ((value (hunchentoot:header-in :connection request))
         (keep-alive-requested-p (and value (connection-option-p value "keep-alive")))
         (protocol (hunchentoot:server-protocol request)))
    (values (and (hunchentoot:acceptor-persistent-connections-p hunchentoot:*acceptor*)
                 (case protocol
                   (:http/1.1 (not (and value (connection-option-p value "close"))))
                   (:http/1.0 keep-alive-requested-p)))
            keep-alive-requested-p
            protocol)))

(sb-ext:define-load-time-global **connection-header-values**
    (list (cons "Keep-Alive" (header-text-octets "Keep-Alive"))
          (cons "Close" (header-text-octets "Close")))
  "The Connection header values START-OUTPUT writes, for a kept-alive reply
and a closing one, each with its octets: strings only the engine holds.")

(defun connection-header-value (kind)
  "The Connection header value of KIND, :KEEP-ALIVE or :CLOSE, as
START-OUTPUT writes it (**CONNECTION-HEADER-VALUES**)."
  (car (ecase kind
         (:keep-alive (first **connection-header-values**))
         (:close (second **connection-header-values**)))))

(defun connection-header-value-octets (value)
  "The octets of VALUE when it is one of CONNECTION-HEADER-VALUE's; else NIL."
  (cdr (assoc value **connection-header-values** :test #'eq)))

(defun set-connection-headers (request slot-reply)
  "Set the Connection and Keep-Alive headers and whether the connection
ends after this reply, as START-OUTPUT does for a reply whose length is
known.  SLOT-REPLY: see SLOT-REPLY."
  (let ((acceptor hunchentoot:*acceptor*))
    (multiple-value-bind (keep-alive-p keep-alive-requested-p protocol) (keep-alive-reply-p request)
      (cond (keep-alive-p
             (setf (finish-processing-connection-p) nil)
             (when (and (hunchentoot:acceptor-read-timeout acceptor)
                        (or (not (eq protocol :http/1.1))
                            keep-alive-requested-p))
               (unless (reply-header :connection slot-reply)
                 (setf (reply-header :connection slot-reply) (connection-header-value :keep-alive)))
               (setf (reply-header :keep-alive slot-reply)
                     (if *serving*
                         (serving-keep-alive-header-value *serving*)
                         (format nil "timeout=~D" (hunchentoot:acceptor-read-timeout acceptor))))))
            ((not (reply-header-p :connection slot-reply))
             (setf (reply-header :connection slot-reply) (connection-header-value :close)))))))

(defun set-server-and-date-headers (slot-reply)
  "Set the Server header, unless the handler set it to NIL, and the Date.
SLOT-REPLY: see SLOT-REPLY."
  (unless (and (reply-header-p :server slot-reply) (null (reply-header :server slot-reply)))
    (setf (reply-header :server slot-reply)
          (or (reply-header :server slot-reply)
              (and *serving* (serving-server-header-value *serving*))
              (acceptor-server-name hunchentoot:*acceptor*))))
  (setf (reply-header :date slot-reply) (date-header-value)))
