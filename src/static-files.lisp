;;;; Static files, sent by the kernel.  SERVE-STATIC-FILE answers a request
;;;; for one file as RFC 9110 asks -- validators (ETag, Last-Modified,
;;;; If-None-Match, If-Modified-Since compared as dates, If-Range), byte
;;;; ranges (single, suffix, open, several as multipart/byteranges, 416 when
;;;; none can be satisfied), a precompressed .gz sibling for a client that
;;;; accepts gzip, HEAD -- and, under a parallel acceptor on a plain
;;;; connection, writes the head as octets and the body with sendfile(2)
;;;; from the descriptor it opened and looked at once: no copy through Lisp.
;;;; Elsewhere (TLS, Hunchentoot's own acceptors) the same reply is copied
;;;; through the connection's stream.  CREATE-STATIC-FOLDER-DISPATCHER-AND-HANDLER
;;;; is HUNCHENTOOT:CREATE-FOLDER-DISPATCHER-AND-HANDLER served this way,
;;;; with the request path kept inside its folder.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +max-byte-ranges+ 64
  "The most ranges one Range header may ask for; past it the header is
ignored and the whole file sent (RFC 9110 14.2 lets a server ignore it).")

(defconstant +copy-buffer-octets+ 65536
  "The piece in which a file is copied where it cannot be sent by sendfile.")

;;; HTTP dates (RFC 9110 5.6.7): IMF-fixdate, and the two obsolete forms a
;;; recipient must still read.

(defparameter *month-names* #("Jan" "Feb" "Mar" "Apr" "May" "Jun" "Jul" "Aug" "Sep" "Oct" "Nov" "Dec"))

(defun parse-http-date (text)
  "The universal time TEXT names as an HTTP date, or NIL."
  (flet ((date (day month year hour minute second)
           (let ((month-number (position month *month-names* :test #'string-equal)))
             (and month-number
                  (ignore-errors (encode-universal-time second minute hour day (1+ month-number) year 0))))))
    (or (cl-ppcre:register-groups-bind ((#'parse-integer day) month (#'parse-integer year hour minute second))
            ("^\\s*[A-Za-z]{3}, (\\d{2}) ([A-Za-z]{3}) (\\d{4}) (\\d{2}):(\\d{2}):(\\d{2}) GMT\\s*$" text)
          (date day month year hour minute second))
        (cl-ppcre:register-groups-bind ((#'parse-integer day) month (#'parse-integer two-digit-year hour minute second))
            ("^\\s*[A-Za-z]+, (\\d{2})-([A-Za-z]{3})-(\\d{2}) (\\d{2}):(\\d{2}):(\\d{2}) GMT\\s*$" text)
          ;; RFC 9110: a two-digit year more than 50 years ahead is in the past century.
          (let* ((this-year (nth-value 5 (decode-universal-time (get-universal-time) 0)))
                 (year (+ (* 100 (floor this-year 100)) two-digit-year)))
            (date day month (if (> year (+ this-year 50)) (- year 100) year) hour minute second)))
        (cl-ppcre:register-groups-bind (month (#'parse-integer day hour minute second year))
            ("^\\s*[A-Za-z]{3} ([A-Za-z]{3}) +(\\d{1,2}) (\\d{2}):(\\d{2}):(\\d{2}) (\\d{4})\\s*$" text)
          (date day month year hour minute second)))))

;;; The file to send.

(defstruct (file-to-send (:constructor %make-file-to-send (fd size modified content-encoding)))
  "A regular file opened for one reply."
  (fd -1 :type fixnum :read-only t)
  (size 0 :type (integer 0) :read-only t)
  ;; Its modification time, a universal time.
  (modified 0 :type integer :read-only t)
  ;; "gzip" when this is the precompressed sibling, else NIL.
  (content-encoding nil :read-only t))

(defun open-file-to-send (namestring &optional content-encoding)
  (multiple-value-bind (fd size modified) (open-regular-file namestring)
    (and fd (%make-file-to-send fd size modified content-encoding))))

(defun entity-tag (file)
  "FILE's strong entity tag, from its size, modification time and coding."
  (format nil "\"~(~x-~x~)~@[-~A~]\"" (file-to-send-size file) (file-to-send-modified file)
          (file-to-send-content-encoding file)))

(defun accepts-gzip-p (accept-encoding)
  "True when the Accept-Encoding value ACCEPT-ENCODING accepts gzip (by name
or as *) with a weight above zero."
  (and accept-encoding
       (loop for coding in (cl-ppcre:split "\\s*,\\s*" accept-encoding)
             thereis (cl-ppcre:register-groups-bind (name weight)
                         ("(?i)^\\s*(gzip|x-gzip|\\*)\\s*(?:;\\s*q\\s*=\\s*([0-9.]+))?\\s*$" coding)
                       (declare (ignore name))
                       ;; A weight of zero (0, 0., 0.000) refuses the coding.
                       (or (null weight)
                           (not (cl-ppcre:scan "^0\\.?0*$" weight)))))))

;;; Preconditions (RFC 9110 13.2.2, for GET and HEAD).

(defun entity-tag-listed-p (tag header-value)
  "True when the If-None-Match HEADER-VALUE names TAG or is *, compared
weakly (W/ aside), as RFC 9110 13.1.2 says."
  (flet ((opaque (text) (if (and (> (length text) 2) (string= "W/" text :end2 2)) (subseq text 2) text)))
    (let ((wanted (opaque tag)))
      (loop for listed in (cl-ppcre:split "\\s*,\\s*" (string-trim " " header-value))
            thereis (or (string= listed "*") (string= (opaque listed) wanted))))))

(defun not-modified-p (file tag)
  "True when the request's If-None-Match, else its If-Modified-Since, says
the client's copy of FILE is current."
  (let ((if-none-match (hunchentoot:header-in* :if-none-match))
        (if-modified-since (hunchentoot:header-in* :if-modified-since)))
    (cond (if-none-match (entity-tag-listed-p tag if-none-match))
          (if-modified-since
           (let ((date (parse-http-date if-modified-since)))
             (and date (<= (file-to-send-modified file) date)))))))

(defun range-applies-p (file tag)
  "False when an If-Range header names another version of FILE than the one
there is: an entity tag compared strongly, or a date that is not exactly
its Last-Modified."
  (let ((if-range (hunchentoot:header-in* :if-range)))
    (or (null if-range)
        (if (find #\" if-range)
            (string= (string-trim " " if-range) tag)
            (eql (parse-http-date if-range) (file-to-send-modified file))))))

;;; Ranges (RFC 9110 14.1.2).

(defun parse-byte-ranges (header-value size)
  "The ranges the Range HEADER-VALUE asks of a file of SIZE octets: a list
of (START . END) with END exclusive, clamped to the file; :UNSATISFIABLE
when none overlaps it; NIL when the header is to be ignored (malformed, a
unit other than bytes, or more than +MAX-BYTE-RANGES+ ranges)."
  (let ((specs (cl-ppcre:register-groups-bind (list) ("^\\s*bytes\\s*=\\s*(.*?)\\s*$" header-value)
                 (cl-ppcre:split "\\s*,\\s*" list))))
    (when (and specs (<= (length specs) +max-byte-ranges+))
      (let ((ranges '()))
        (dolist (spec specs)
          (let ((range (or (cl-ppcre:register-groups-bind ((#'parse-integer start last)) ("^(\\d+)-(\\d+)?$" spec)
                             ;; LAST is NIL for an open range.
                             (cond ((and last (< last start)) (return-from parse-byte-ranges nil))
                                   ((>= start size) :unsatisfiable)
                                   (t (cons start (if last (min size (1+ last)) size)))))
                           (cl-ppcre:register-groups-bind ((#'parse-integer length)) ("^-(\\d+)$" spec)
                             (if (or (zerop length) (zerop size))
                                 :unsatisfiable
                                 (cons (max 0 (- size length)) size)))
                           (return-from parse-byte-ranges nil))))
            (unless (eq range :unsatisfiable)
              (push range ranges))))
        (or (nreverse ranges) :unsatisfiable)))))

;;; Sending.

(defun copy-file-octets (file stream start end)
  "Write the octets of FILE from START below END to STREAM through a buffer.
True when they all could be read."
  (let ((buffer (make-array (min +copy-buffer-octets+ (max 1 (- end start))) :element-type '(unsigned-byte 8))))
    (loop for position = start then (+ position count)
          for count = (and (< position end)
                           (read-file-octets (file-to-send-fd file) buffer position))
          while (and count (plusp count))
          do (write-sequence buffer stream :end (min count (- end position)))
          finally (return (>= position end)))))

(defun send-file-body (file stream start end)
  "Send FILE's octets from START below END after the head written to STREAM:
by sendfile(2) when STREAM is the plain connection, else copied.  True
when all of them went."
  (let ((socket-fd (stream-file-descriptor stream)))
    (cond (socket-fd
           (finish-output stream)
           (send-file-octets socket-fd (file-to-send-fd file) start end
                             (hunchentoot:acceptor-write-timeout hunchentoot:*acceptor*)))
          (t (copy-file-octets file stream start end)))))

(defun call-with-file-reply (request return-code content-length function)
  "Write RETURN-CODE's head for a body of CONTENT-LENGTH octets, then call
FUNCTION with the stream to write the body to, and return its value.  On a
plain connection the socket is corked from before the head leaves until
the body is sent, so that head and body share segments."
  (if (typep hunchentoot:*acceptor* 'parallel-acceptor)
      (let* ((stream (send-reply-head request return-code content-length))
             (socket-fd (stream-file-descriptor stream)))
        (if socket-fd
            (progn
              (setf (tcp-corked-p socket-fd) t)
              (unwind-protect (prog1 (funcall function stream)
                                     (finish-output stream))
                (setf (tcp-corked-p socket-fd) nil)))
            (funcall function stream)))
      (progn (setf (hunchentoot:return-code*) return-code
                   (hunchentoot:content-length*) content-length)
             (funcall function (hunchentoot:send-headers)))))

(defun multipart-parts (ranges size content-type boundary)
  "Each part of a multipart/byteranges body: (START END . PART-HEAD-OCTETS)."
  (loop for (start . end) in ranges
        collect (list* start end
                       (flex:string-to-octets
                        (format nil "~C~C--~A~C~CContent-Type: ~A~C~CContent-Range: bytes ~D-~D/~D~C~C~C~C"
                                #\Return #\Linefeed boundary #\Return #\Linefeed content-type #\Return #\Linefeed
                                start (1- end) size #\Return #\Linefeed #\Return #\Linefeed)
                        :external-format :latin-1))))

(defun send-file-reply (request file content-type tag)
  "Answer REQUEST with FILE: 304, 416, 206 or 200 as its preconditions and
Range header say.  The connection is closed after a body that could not
be sent whole."
  (let ((size (file-to-send-size file))
        (head-p (eq (hunchentoot:request-method request) :head)))
    (when (not-modified-p file tag)
      (end-request-with hunchentoot:+http-not-modified+))
    (let* ((range-header (hunchentoot:header-in* :range))
           (ranges (and range-header
                        (eq (hunchentoot:request-method request) :get)
                        (range-applies-p file tag)
                        (parse-byte-ranges range-header size)))
           (sent-whole-p
             (cond ((eq ranges :unsatisfiable)
                    (setf (hunchentoot:header-out :content-range) (format nil "bytes */~D" size))
                    (end-request-with hunchentoot:+http-requested-range-not-satisfiable+))
                   ((null ranges)
                    (call-with-file-reply request hunchentoot:+http-ok+ size
                                          (lambda (stream)
                                            (or head-p (send-file-body file stream 0 size)))))
                   ((null (rest ranges))
                    (destructuring-bind ((start . end)) ranges
                      (setf (hunchentoot:header-out :content-range)
                            (format nil "bytes ~D-~D/~D" start (1- end) size))
                      (call-with-file-reply request hunchentoot:+http-partial-content+ (- end start)
                                            (lambda (stream)
                                              (send-file-body file stream start end)))))
                   (t
                    (let* ((boundary (format nil "~36R~36R" (random (expt 2 62)) (get-universal-time)))
                           (parts (multipart-parts ranges size content-type boundary))
                           (closing (flex:string-to-octets (format nil "~C~C--~A--~C~C" #\Return #\Linefeed
                                                                   boundary #\Return #\Linefeed)
                                                           :external-format :latin-1)))
                      (setf (hunchentoot:content-type*) (format nil "multipart/byteranges; boundary=~A" boundary))
                      (call-with-file-reply request hunchentoot:+http-partial-content+
                                            (+ (length closing)
                                               (loop for (start end . part-head) in parts
                                                     sum (+ (length part-head) (- end start))))
                                            (lambda (stream)
                                              (and (loop for (start end . part-head) in parts
                                                         always (progn (write-sequence part-head stream)
                                                                       (send-file-body file stream start end)))
                                                   (progn (write-sequence closing stream) t)))))))))
      (unless sent-whole-p
        ;; The client has been promised octets it did not get: the next
        ;; reply on this connection would be read as the rest of them.
        (setf (finish-processing-connection-p) t))
      nil)))

(defun end-request-with (status)
  "End the handler with STATUS, answered with the acceptor's status message."
  (setf (hunchentoot:return-code*) status)
  (hunchentoot:abort-request-handler))

(defun serve-static-file (pathname &key content-type cache-control (precompressed t))
  "A handler's answer with the file PATHNAME, as HUNCHENTOOT:HANDLE-STATIC-FILE
answers it and with what RFC 9110 adds: Last-Modified, a strong ETag (from
the size and modification time), Accept-Ranges, If-None-Match (a list, or
*) and If-Modified-Since compared as dates (304), If-Range, Range (one
range, suffix and open ranges: 206 with Content-Range; several:
multipart/byteranges; none satisfiable: 416 with Content-Range bytes */SIZE),
HEAD.  CONTENT-TYPE defaults to HUNCHENTOOT:MIME-TYPE of PATHNAME's name;
CACHE-CONTROL, when given, is sent as the Cache-Control header.  When
PRECOMPRESSED is true and PATHNAME.gz is a regular file, a client that
accepts gzip gets it with Content-Encoding: gzip (and Vary: Accept-Encoding
either way).  A name that is not a regular file is answered 404.  The file
is opened and looked at once; under a parallel acceptor on a plain
connection the body goes by sendfile(2).  Returns NIL once the reply is
sent, as a handler that sent it itself; unspecified: when the octets leave
the kernel."
  (let* ((namestring (if (pathnamep pathname) (native-path pathname) pathname))
         (gzip-sibling (and precompressed (open-file-to-send (concatenate 'string namestring ".gz") "gzip")))
         (file (if (and gzip-sibling (accepts-gzip-p (hunchentoot:header-in* :accept-encoding)))
                   gzip-sibling
                   (progn (when gzip-sibling (close-fd (file-to-send-fd gzip-sibling)))
                          (open-file-to-send namestring)))))
    (unless file
      (end-request-with hunchentoot:+http-not-found+))
    (unwind-protect
         (let ((content-type (or content-type
                                 (hunchentoot:mime-type (file-namestring namestring))
                                 "application/octet-stream"))
               (tag (entity-tag file)))
           (setf (hunchentoot:content-type*) content-type
                 (hunchentoot:header-out :last-modified) (hunchentoot:rfc-1123-date (file-to-send-modified file))
                 (hunchentoot:header-out :etag) tag
                 (hunchentoot:header-out :accept-ranges) "bytes")
           (when cache-control
             (setf (hunchentoot:header-out :cache-control) cache-control))
           (when gzip-sibling
             (setf (hunchentoot:header-out :vary) "Accept-Encoding"))
           (when (file-to-send-content-encoding file)
             (setf (hunchentoot:header-out :content-encoding) (file-to-send-content-encoding file)))
           (send-file-reply hunchentoot:*request* file content-type tag))
      (close-fd (file-to-send-fd file)))))

;;; The folder dispatcher.

(defun folder-relative-path (script-name uri-prefix)
  "The path below URI-PREFIX that SCRIPT-NAME names, as the folder's own
relative native path; :FORBIDDEN when it climbs (a .. segment, as
Hunchentoot answers 403); NIL when it cannot name a file there (an empty
or . segment, a directory, a NUL or a backslash)."
  (let ((relative (subseq script-name (length uri-prefix))))
    (cond ((or (zerop (length relative))
               (find (code-char 0) relative)
               (find #\\ relative))
           nil)
          (t
           (let ((segments (cl-ppcre:split "/" relative :limit most-positive-fixnum)))
             (cond ((member ".." segments :test #'string=) :forbidden)
                   ((some (lambda (segment) (or (string= segment "") (string= segment "."))) segments)
                    nil)
                   (t relative)))))))

(defun create-static-folder-dispatcher-and-handler (uri-prefix base-path &optional content-type cache-control
                                                                                  follow-outside-links-p)
  "HUNCHENTOOT:CREATE-FOLDER-DISPATCHER-AND-HANDLER, the file sent by
SERVE-STATIC-FILE: a dispatch function for HUNCHENTOOT:*DISPATCH-TABLE*
that answers a request whose script name starts with URI-PREFIX (a string
ending with a slash) with the file relative to BASE-PATH (an existing
directory) that the rest of it names.  CONTENT-TYPE, when given, is every
file's type; CACHE-CONTROL the Cache-Control header of every reply.  A path
that climbs out of the folder (..) is answered 403; one with an empty or .
segment, a NUL or a backslash, or naming a directory, 404.  A symbolic
link that leads outside BASE-PATH is answered 404 unless
FOLLOW-OUTSIDE-LINKS-P."
  (unless (and (stringp uri-prefix)
               (plusp (length uri-prefix))
               (char= (char uri-prefix (1- (length uri-prefix))) #\/))
    (error 'invalid-static-folder :initarg 'uri-prefix :value uri-prefix
                                  :reason "must be a string ending with a slash"))
  (let ((folder (let ((probed (ignore-errors (probe-file base-path))))
                  (and probed (real-path (native-path probed))))))
    (unless (and folder (directory-path-p folder))
      (error 'invalid-static-folder :initarg 'base-path :value base-path
                                    :reason "names no existing directory"))
    (let ((folder-prefix (if (char= (char folder (1- (length folder))) #\/) folder (concatenate 'string folder "/"))))
      (hunchentoot:create-prefix-dispatcher
       uri-prefix
       (lambda ()
         (let ((relative (folder-relative-path (hunchentoot:script-name*) uri-prefix)))
           (case relative
             ((nil) (end-request-with hunchentoot:+http-not-found+))
             (:forbidden (end-request-with hunchentoot:+http-forbidden+)))
           (let* ((namestring (concatenate 'string folder-prefix relative))
                  (resolved (real-path namestring)))
             (unless (and resolved
                          (or follow-outside-links-p
                              (and (> (length resolved) (length folder-prefix))
                                   (string= folder-prefix resolved :end2 (length folder-prefix)))))
               (end-request-with hunchentoot:+http-not-found+))
             (serve-static-file namestring :content-type content-type :cache-control cache-control))))))))
